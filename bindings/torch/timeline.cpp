#include "timeline.hpp"

#include <utility>

namespace gradzip::torch_ext {

double Timeline::now_ms() const {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - origin_)
      .count();
}

void Timeline::add(Event event) {
  const std::lock_guard<std::mutex> lock(mutex_);
  events_.push_back(std::move(event));
}

std::vector<Timeline::Event> Timeline::take() {
  const std::lock_guard<std::mutex> lock(mutex_);
  return std::exchange(events_, {});
}

const char* step_name(Step step) {
  switch (step) {
    case Step::encode: return "encode";
    case Step::allreduce_payload: return "all-reduce";
    case Step::alltoall: return "all-to-all";
    case Step::reduce_owner: return "owner sum + re-encode";
    case Step::allgather: return "all-gather";
    case Step::decode: return "decode";
    case Step::sum_shard: return "sum shard";
  }
  return "?";
}

}  // namespace gradzip::torch_ext
