#include "engine/events.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <ctime>
#include <nlohmann/json.hpp>

#include "kernels/error.h"

namespace rondo::engine {
namespace {

using nlohmann::json;

std::int64_t steady_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

std::string utc_now() {
  auto now = std::chrono::system_clock::now();
  std::time_t secs = std::chrono::system_clock::to_time_t(now);
  auto ms =
      std::chrono::duration_cast<std::chrono::milliseconds>(now.time_since_epoch()).count() % 1000;
  std::tm tm{};
  gmtime_r(&secs, &tm);
  char buf[64];  // room for any int the compiler imagines
  std::snprintf(buf, sizeof buf, "%04d-%02d-%02dT%02d:%02d:%02d.%03dZ", tm.tm_year + 1900,
                tm.tm_mon + 1, tm.tm_mday, tm.tm_hour, tm.tm_min, tm.tm_sec, static_cast<int>(ms));
  return buf;
}

}  // namespace

std::unique_ptr<EventSink> EventSink::open(const std::string& path) {
  if (path == "-") {
    std::fflush(stdout);  // what was printed before goes first
    return std::unique_ptr<EventSink>(new EventSink(STDOUT_FILENO, false));
  }
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
  if (fd < 0) throw Error("cannot open the event stream " + path + ": " + std::strerror(errno));
  return std::unique_ptr<EventSink>(new EventSink(fd, true));
}

EventSink::EventSink(int fd, bool owned) : fd_(fd), owned_(owned), start_ns_(steady_ns()) {}

EventSink::~EventSink() {
  if (owned_ && ::close(fd_) != 0)
    std::fprintf(stderr, "rondo: warning: closing the event stream failed: %s\n",
                 std::strerror(errno));
}

double EventSink::now() const {
  return (steady_ns() - start_ns_) * 1e-9;
}

void EventSink::write(const char* type, const std::string& fields) {
  // The clock is read under the lock, so "t" never goes backwards down the file.
  std::lock_guard lock(mutex_);
  json head = {{"v", kEventSchemaVersion}, {"type", type}, {"t", now()}, {"time", utc_now()}};
  std::string line = head.dump();
  // Splice the event's own members after the common ones: {"v":..,"time":"..", <fields>}.
  if (fields.size() > 2) {
    line.pop_back();
    line += ",";
    line.append(fields, 1, std::string::npos);
  }
  line += "\n";
  // One write() for the whole line: with O_APPEND the kernel places it whole at the end of the
  // file, so a reader never sees half a line followed by another. (A regular file takes it all at
  // once; a pipe may take part, then the rest follows at once.) A failed write must not kill
  // training; it is reported once on stderr.
  std::string failure;  // empty while the writes go through
  for (std::size_t done = 0; failure.empty() && done < line.size();) {
    const ssize_t n = ::write(fd_, line.data() + done, line.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0)
      failure = std::strerror(errno);
    else if (n == 0)  // no error set: errno would be a stale one
      failure = "the file took no bytes";
    else
      done += static_cast<std::size_t>(n);
  }
  if (!failure.empty()) {
    static bool warned = false;
    if (!warned) {
      warned = true;
      std::fprintf(stderr, "rondo: warning: writing the event stream failed: %s\n",
                   failure.c_str());
    }
  }
}

void EventSink::emit(const RunStartEvent& e) {
  write("run_start", json{{"run_dir", e.run_dir},
                          {"model", e.model},
                          {"method", e.method},
                          {"steps_total", e.steps_total},
                          {"config", e.config_toml},
                          {"resumed_from", e.resumed_from},
                          {"rank", e.rank},
                          {"ranks", e.ranks}}
                         .dump());
}

void EventSink::emit(const PlanEvent& e) {
  json j{{"plan", e.plan},
         {"devices", e.devices},
         {"microbatches", e.microbatches},
         {"predicted_step_s", e.predicted_step_s},
         {"predicted_idle_fraction", e.predicted_idle_fraction},
         {"predicted_peak_bytes", e.predicted_peak_bytes},
         {"predicted_bytes_up", e.predicted_bytes_up},
         {"predicted_bytes_down", e.predicted_bytes_down},
         {"predicted_nvme_read", e.predicted_nvme_read},
         {"predicted_nvme_write", e.predicted_nvme_write},
         {"partitioner", e.partitioner}};
  if (!e.placement_json.empty()) j["placement"] = json::parse(e.placement_json);
  write("plan", j.dump());
}

namespace {

// A preference objective's metrics as one object (absent for supervised runs).
void add_metrics(json& j, const std::vector<std::pair<std::string, double>>& metrics) {
  if (metrics.empty()) return;
  json m = json::object();
  for (const auto& [name, value] : metrics)
    m[name] = value;
  j["metrics"] = std::move(m);
}

}  // namespace

void EventSink::emit(const StepEvent& e) {
  json j{{"step", e.step},           {"steps_total", e.steps_total},
         {"loss", e.loss},           {"lr", e.lr},
         {"grad_norm", e.grad_norm}, {"tokens_per_s", e.tokens_per_s},
         {"eta_s", e.eta_s},         {"tokens", e.tokens}};
  add_metrics(j, e.metrics);
  write("step", j.dump());
}

void EventSink::emit(const EvalEvent& e) {
  json j{{"step", e.step}, {"loss", e.loss}, {"tokens", e.tokens}};
  add_metrics(j, e.metrics);
  write("eval", j.dump());
}

void EventSink::emit(const SampleEvent& e) {
  write("sample", json{{"step", e.step}, {"prompt", e.prompt}, {"text", e.text}}.dump(
                      -1, ' ', false, json::error_handler_t::replace));
}

void EventSink::emit(const DeviceEvent& e) {
  write("device", json{{"device", e.device},
                       {"name", e.name},
                       {"bytes_in_use", e.bytes_in_use},
                       {"bytes_peak", e.bytes_peak},
                       {"bytes_cap", e.bytes_cap},
                       {"busy_fraction", e.busy_fraction},
                       {"bytes_h2d", e.bytes_h2d},
                       {"bytes_d2h", e.bytes_d2h}}
                      .dump());
}

void EventSink::emit(const SpanEvent& e) {
  write("span", json{{"device", e.device},
                     {"step", e.step},
                     {"stage", e.stage},
                     {"first_layer", e.first_layer},
                     {"end_layer", e.end_layer},
                     {"start", e.start},
                     {"end", e.end}}
                    .dump());
}

void EventSink::emit(const CheckpointEvent& e) {
  write("checkpoint", json{{"step", e.step}, {"path", e.path}, {"bytes", e.bytes}}.dump());
}

void EventSink::emit(const LoadEvent& e) {
  write("load", json{{"layers_done", e.layers_done}, {"layers_total", e.layers_total}}.dump());
}

void EventSink::warning(const std::string& message) {
  write("warning", json{{"message", message}}.dump(-1, ' ', false, json::error_handler_t::replace));
}

void EventSink::error(const std::string& message) {
  write("error", json{{"message", message}}.dump(-1, ' ', false, json::error_handler_t::replace));
}

void EventSink::emit(const RunEndEvent& e) {
  write("run_end", json{{"status", e.status},
                        {"steps", e.steps},
                        {"seconds", e.seconds},
                        {"export_path", e.export_path},
                        {"host_peak_bytes", e.host_peak_bytes},
                        {"host_budget_bytes", e.host_budget_bytes},
                        {"host_arena_peak_bytes", e.host_arena_peak_bytes},
                        {"host_overhead_bytes", e.host_overhead_bytes},
                        {"nvme_backend", e.nvme_backend},
                        {"nvme_read_bytes", e.nvme_read_bytes},
                        {"nvme_written_bytes", e.nvme_written_bytes}}
                       .dump());
}

}  // namespace rondo::engine
