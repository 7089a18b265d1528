// What the CPU pipeline of CompressedAllreduce did and when, for the benchmarks' timeline
// (bench/torch/bench_phases.py): one event per phase a thread computed, and per collective from
// its start to the return of its wait(). Off unless asked for (CompressedAllreduce::set_timeline):
// then every event costs a clock read and a locked push.
#pragma once

#include <chrono>
#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

#include "reduction.hpp"

namespace gradzip::torch_ext {

class Timeline {
 public:
  struct Event {
    int64_t bucket = 0, part = 0;
    Step step = Step::encode;
    std::string thread;  // "issue" or "finish": the pipeline thread that ran or waited for it
    double start_ms = 0, end_ms = 0;  // since the timeline was made
  };

  double now_ms() const;
  void add(Event event);
  std::vector<Event> take();

 private:
  const std::chrono::steady_clock::time_point origin_ = std::chrono::steady_clock::now();
  std::mutex mutex_;
  std::vector<Event> events_;
};

}  // namespace gradzip::torch_ext
