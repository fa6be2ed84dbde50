// The ranks of a data-parallel run (ranks.h): the launcher's variables, and c10d's TCPStore and
// ProcessGroupGloo from the libtorch Rondo links. This is the one file that includes
// ProcessGroupGloo.hpp, with Debian's gloo headers: Note [Gloo's headers] says why that is safe,
// and what this file must therefore never do.
#include "engine/ranks.h"

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <chrono>
#include <cstdlib>
#include <limits>
#include <vector>

#include "kernels/error.h"

// Note [Gloo's headers]
// ~~~~~~~~~~~~~~~~~~~~~
// The torch wheel ships c10d's headers but not gloo's, which ProcessGroupGloo.hpp includes; gloo's
// code itself is inside libtorch_cpu.so (its symbols exported). We compile this file against
// Debian's libgloo-dev headers (a 2022 snapshot, older than the wheel's gloo) and never link
// Debian's libgloo. That is sound only because of how little this file touches (checked against
// pytorch/gloo's history in docs/distributed.md):
//   - the c10d classes laid out here (ProcessGroupGloo, its Options) hold gloo's types only
//     behind shared_ptr / unique_ptr, so their layout does not depend on gloo's definitions;
//   - gloo's objects are made and used inside libtorch (devices by createDevice*, contexts and
//     GlooStore by ProcessGroupGloo's constructor): no gloo constructor, inline method or vtable
//     is instantiated here. Do not construct GlooStore or call a gloo method in this file;
//   - gloo's errors reach us as std::exception (gloo::IoException derives from it).
// Ranks.TheGlooProcessGroupIsLaidOutAsTheWheelLaysItOut checks that the fields libtorch's
// constructor writes are the ones this layout reads.

namespace rondo::engine {
namespace {

std::string rank_text(int rank, int size) {
  return "rank " + std::to_string(rank) + " of " + std::to_string(size);
}

class GlooCollective final : public Collective {
 public:
  GlooCollective(c10::intrusive_ptr<c10d::ProcessGroupGloo> group, int rank, int size,
                 std::string name)
      : group_(std::move(group)), rank_(rank), size_(size), name_(std::move(name)) {}

  int rank() const override { return rank_; }
  int size() const override { return size_; }

  void all_reduce_sum(float* data, std::size_t n, const std::string& what) override {
    all_reduce(data, n, at::kFloat, what);
  }
  void all_reduce_sum(double* data, std::size_t n, const std::string& what) override {
    all_reduce(data, n, at::kDouble, what);
  }

  std::unique_ptr<Pending> start_sum(const std::vector<Floats>& parts,
                                     const std::string& what) override {
    std::vector<at::Tensor> t;
    for (const Floats& p : parts)
      t.push_back(at::from_blob(p.data, {static_cast<std::int64_t>(p.n)}, at::kFloat));
    if (t.empty() || size_ == 1) return std::make_unique<Started>(*this, nullptr, "", what);
    return std::make_unique<Started>(*this,
                                     start("all-reduce", what,
                                           [&] {
                                             if (t.size() == 1) {
                                               c10d::AllreduceOptions o;
                                               o.reduceOp = c10d::ReduceOp::SUM;
                                               return group_->allreduce(t, o);
                                             }
                                             c10d::AllreduceCoalescedOptions o;
                                             o.reduceOp = c10d::ReduceOp::SUM;
                                             return group_->allreduce_coalesced(t, o);
                                           }),
                                     "all-reduce", what);
  }

  void broadcast(void* data, std::size_t bytes, int root, const std::string& what) override {
    start_broadcast(data, bytes, root, what)->wait();
  }

  std::unique_ptr<Pending> start_broadcast(void* data, std::size_t bytes, int root,
                                           const std::string& what) override {
    if (bytes == 0 || size_ == 1) return std::make_unique<Started>(*this, nullptr, "", what);
    std::vector<at::Tensor> t{bytes_of(data, bytes)};
    c10d::BroadcastOptions o;
    o.rootRank = root;
    return std::make_unique<Started>(
        *this, start("broadcast", what, [&] { return group_->broadcast(t, o); }), "broadcast",
        what);
  }

  void send(const void* data, std::size_t bytes, int to, const std::string& what) override {
    if (bytes == 0) return;
    std::vector<at::Tensor> t{bytes_of(const_cast<void*>(data), bytes)};
    run("send", what, [&] { return group_->send(t, to, /*tag=*/0); });
  }

  void recv(void* data, std::size_t bytes, int from, const std::string& what) override {
    if (bytes == 0) return;
    std::vector<at::Tensor> t{bytes_of(data, bytes)};
    run("receive", what, [&] { return group_->recv(t, from, /*tag=*/0); });
  }

 private:
  // Gloo ignores strides: only a contiguous buffer may be passed (from_blob's is).
  static at::Tensor bytes_of(void* data, std::size_t bytes) {
    return at::from_blob(data, {static_cast<std::int64_t>(bytes)}, at::kByte);
  }

  void all_reduce(void* data, std::size_t n, at::ScalarType type, const std::string& what) {
    if (n == 0 || size_ == 1) return;
    // Gloo ignores strides: only a contiguous buffer may be passed (from_blob's is).
    std::vector<at::Tensor> t{at::from_blob(data, {static_cast<std::int64_t>(n)}, type)};
    c10d::AllreduceOptions o;
    o.reduceOp = c10d::ReduceOp::SUM;
    run("all-reduce", what, [&] { return group_->allreduce(t, o); });
  }

  class Started final : public Pending {
   public:
    Started(GlooCollective& group, c10::intrusive_ptr<c10d::Work> work, const char* op,
            std::string what)
        : group_(group), work_(std::move(work)), op_(op), what_(std::move(what)) {}
    bool done() override { return !work_ || work_->isCompleted(); }
    void wait() override {
      if (!work_) return;
      try {
        work_->wait();
      } catch (const std::exception& e) {
        group_.fail(op_, what_, e);
      }
      work_.reset();
    }

   private:
    GlooCollective& group_;
    c10::intrusive_ptr<c10d::Work> work_;
    const char* op_;
    std::string what_;
  };

  template <typename Start>
  c10::intrusive_ptr<c10d::Work> start(const char* op, const std::string& what, Start begin) {
    try {
      return begin();
    } catch (const std::exception& e) {
      fail(op, what, e);
    }
  }

  template <typename Start>
  void run(const char* op, const std::string& what, Start begin) {
    c10::intrusive_ptr<c10d::Work> work = start(op, what, begin);
    try {
      work->wait();
    } catch (const std::exception& e) {
      fail(op, what, e);
    }
  }

  // gloo::IoException (a peer closed its connection: it died), c10::Error (a timeout), ...
  [[noreturn]] void fail(const char* op, const std::string& what, const std::exception& e) const {
    throw RankError(rank_text(rank_, size_) + ": the " + op + " of " + what + " (" + name_ +
                    " group) failed: " + first_line(e.what()) +
                    ". Another rank has stopped or died; its own output says why. Resume the run "
                    "from its last checkpoint with `rondo train --resume`");
  }

  // Gloo's message without its advice (ours follows) and anything after its first line.
  static std::string first_line(const std::string& s) {
    std::string line = s.substr(0, s.find('\n'));
    if (const auto advice = line.find(". This is typically caused"); advice != std::string::npos)
      line.resize(advice);
    return line;
  }

  c10::intrusive_ptr<c10d::ProcessGroupGloo> group_;
  int rank_, size_;
  std::string name_;
};

bool is_loopback(const std::string& host) {
  return host == "localhost" || host.rfind("127.", 0) == 0 || host == "::1";
}

class GlooRanks final : public Ranks {
 public:
  GlooRanks(const RankEnv& env, const DistributedSettings& settings) : env_(env) {
    if (settings.backend != "gloo")
      throw Error("distributed.backend = \"" + settings.backend +
                  "\": only \"gloo\" is supported (gradients are summed in host memory)");
    auto ms = [](double s) {
      return std::chrono::milliseconds(static_cast<std::int64_t>(std::min(s, 1e9) * 1000.0));
    };
    const auto timeout = ms(settings.timeout_s);
    meet_timeout_ = ms(settings.meet_timeout_s);
    c10::intrusive_ptr<c10d::Store> store;
    try {
      c10d::TCPStoreOptions so;
      so.port = static_cast<std::uint16_t>(env.master_port);
      so.isServer = env.rank == 0 && !env.agent_store;
      so.numWorkers = static_cast<std::size_t>(env.world);
      so.waitWorkers = !env.agent_store;
      // Ranks start when their launcher gets to them: the rendezvous waits as meetings do.
      so.timeout = meet_timeout_;
      store = c10::make_intrusive<c10d::TCPStore>(env.master_addr, so);
    } catch (const std::exception& e) {
      throw Error(rank_text(env.rank, env.world) + ": could not meet the other ranks at " +
                  env.master_addr + ":" + std::to_string(env.master_port) + " within " +
                  std::to_string(static_cast<int>(settings.meet_timeout_s)) + " s (" + e.what() +
                  "). Check that every rank was started with the same master address and port, "
                  "that rank 0 is running and that the port is free");
    }
    // As torch.distributed does under torchrun: keys of an earlier attempt are not read again.
    const std::string attempt = "/rondo/attempt_" + std::to_string(env.restart_count) + "/";
    auto options = c10d::ProcessGroupGloo::Options::create(timeout);
    try {
      if (!settings.interface.empty())
        options->devices.push_back(
            c10d::ProcessGroupGloo::createDeviceForInterface(settings.interface));
      else if (is_loopback(env.master_addr))
        options->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1"));
      else
        options->devices.push_back(c10d::ProcessGroupGloo::createDefaultDevice());
    } catch (const std::exception& e) {
      throw Error(
          rank_text(env.rank, env.world) + ": no network device for Gloo" +
          (settings.interface.empty() ? std::string() : " on interface " + settings.interface) +
          ": " + e.what() + ". Set distributed.interface to the interface that reaches " +
          env.master_addr);
    }
    options->threads = 2;
    auto group = [&](const std::string& name) {
      try {
        auto prefixed = c10::make_intrusive<c10d::PrefixStore>(attempt + name, store);
        return std::make_unique<GlooCollective>(
            c10::make_intrusive<c10d::ProcessGroupGloo>(prefixed, env.rank, env.world, options),
            env.rank, env.world, name);
      } catch (const std::exception& e) {
        throw Error(rank_text(env.rank, env.world) + ": could not connect to the other ranks (" +
                    name + " group): " + e.what());
      }
    };
    steps_ = group("steps");
    gradients_ = group("gradients");
    meetings_ = c10::make_intrusive<c10d::PrefixStore>(attempt + "meet", store);
  }

  void meet(const std::string& what) override {
    const std::string key = std::to_string(++meetings_held_);
    at_store(what, [&] {
      if (meetings_->add(key, 1) == env_.world) meetings_->set(key + "/all", std::string("1"));
      meetings_->wait({key + "/all"}, meet_timeout_);
    });
  }

  bool rank_0_says(const std::string& what, bool ok) override {
    const std::string key = "says/" + std::to_string(++meetings_held_);
    at_store(what, [&] {
      if (env_.rank == 0) {
        meetings_->set(key, std::string(ok ? "1" : "0"));
      } else {
        meetings_->wait({key}, meet_timeout_);
        const std::vector<std::uint8_t> v = meetings_->get(key);
        ok = v.size() == 1 && v[0] == '1';
      }
    });
    return ok;
  }

  Collective& steps() override { return *steps_; }
  Collective& gradients() override { return *gradients_; }
  int rank() const override { return env_.rank; }
  int size() const override { return env_.world; }

 private:
  template <typename F>
  void at_store(const std::string& what, F f) {
    try {
      f();
    } catch (const std::exception& e) {
      throw RankError(rank_text(env_.rank, env_.world) + ": waiting for the other ranks (" + what +
                      ") failed: " + std::string(e.what()).substr(0, 300) +
                      ". A rank has stopped, died or taken longer than distributed.meet_timeout; "
                      "its own output says why");
    }
  }

  RankEnv env_;
  std::unique_ptr<GlooCollective> steps_, gradients_;
  c10::intrusive_ptr<c10d::Store> meetings_;
  std::chrono::milliseconds meet_timeout_{0};
  std::int64_t meetings_held_ = 0;
};

}  // namespace

std::vector<std::vector<int>> gradient_buckets(const std::vector<std::size_t>& layer_bytes) {
  std::vector<std::vector<int>> buckets;
  std::size_t bytes = 0;
  for (int l = static_cast<int>(layer_bytes.size()) - 1; l >= 0; --l) {
    const std::size_t b = layer_bytes[static_cast<std::size_t>(l)];
    if (b == 0) continue;
    if (buckets.empty() || bytes >= kGradientBucketBytes) {
      buckets.emplace_back();
      bytes = 0;
    }
    buckets.back().push_back(l);
    bytes += b;
  }
  return buckets;
}

void broadcast_string(Collective& ranks, std::string& text, int root, const std::string& what) {
  std::uint64_t n = text.size();
  ranks.broadcast(&n, sizeof n, root, what);
  text.resize(n);
  ranks.broadcast(text.data(), n, root, what);
}

std::unique_ptr<Ranks> Ranks::connect(const RankEnv& env, const DistributedSettings& settings) {
  if (env.world < 1 || env.rank < 0 || env.rank >= env.world)
    throw Error("rank " + std::to_string(env.rank) + " is not in 0.." +
                std::to_string(env.world - 1));
  if (!(settings.timeout_s > 0)) throw Error("distributed.timeout must be positive (seconds)");
  return std::make_unique<GlooRanks>(env, settings);
}

}  // namespace rondo::engine
