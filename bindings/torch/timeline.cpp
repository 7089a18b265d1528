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

}  // namespace gradzip::torch_ext
