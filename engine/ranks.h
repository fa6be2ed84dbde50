// Data parallelism across processes (docs/distributed.md): every process (a rank: a node, or a
// group of GPUs on one node) runs its own pipeline on its share of each step's microbatches; the
// gradients, summed in host memory as they land, are summed across ranks before the optimizer, so
// every rank's update is the same. The collectives are torch's c10d over Gloo (TCP), the engine
// sees them through `Collective` alone (no torch or gloo in this header).
//
//   RankEnv env{.rank = 1, .world = 2, .master_addr = "node0"};  // the CLI reads the launcher's
//   std::unique_ptr<Ranks> ranks = Ranks::connect(env, {});       // rendezvous with the others
//   options.data_parallel = {.steps = &ranks->steps(), .gradients = &ranks->gradients()};
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "kernels/error.h"

namespace rondo::engine {

// One group of ranks, used by one thread at a time: every rank must call the same collectives in
// the same order. A failure (a peer that died, or did not answer within the timeout) throws
// RankError naming this rank, the operation and `what` the caller said it was doing.
class Collective {
 public:
  virtual ~Collective() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  // Sums `n` contiguous values in place across the ranks.
  virtual void all_reduce_sum(float* data, std::size_t n, const std::string& what) = 0;
  virtual void all_reduce_sum(double* data, std::size_t n, const std::string& what) = 0;
  // Starts summing several buffers in one collective (in place where they follow each other in
  // memory; else c10d's allreduce_coalesced, which copies them into one buffer and back) and
  // returns at once; every rank passes buffers of the same sizes in the same order. The buffers
  // must stay untouched until wait() returns. Several may be in flight (the process group's threads
  // run them concurrently, matched across ranks by the order they were started in).
  struct Floats {
    float* data = nullptr;
    std::size_t n = 0;
  };
  class Pending {
   public:
    virtual ~Pending() = default;
    virtual bool done() = 0;  // finished (wait() would not block)
    virtual void wait() = 0;  // throws RankError as the blocking calls do
  };
  virtual std::unique_ptr<Pending> start_sum(const std::vector<Floats>& parts,
                                             const std::string& what) = 0;
  // Rank `root`'s `bytes` bytes at `data` on every rank.
  virtual void broadcast(void* data, std::size_t bytes, int root, const std::string& what) = 0;
  // The same, started (as start_sum): several in flight, matched across ranks by the order they
  // were started in; `data` untouched (root) or unread (the others) until wait() returns.
  virtual std::unique_ptr<Pending> start_broadcast(void* data, std::size_t bytes, int root,
                                                   const std::string& what) = 0;
  // Point to point: `bytes` bytes to rank `to`, or from rank `from` (blocking; the sizes must
  // match). Messages between two ranks arrive in the order they were sent.
  virtual void send(const void* data, std::size_t bytes, int to, const std::string& what) = 0;
  virtual void recv(void* data, std::size_t bytes, int from, const std::string& what) = 0;
};

class RankError : public Error {
 public:
  using Error::Error;
};

// Data parallel: layers' gradients are summed across ranks in buckets of at least this many bytes
// (the last may hold less): consecutive layers, whose gradients a store keeps back to back, so a
// bucket is one buffer summed in place, and a LoRA's many small layers do not pay a collective's
// latency each. Buckets are summed asynchronously, several in flight.
inline constexpr std::size_t kGradientBucketBytes = 16ull << 20;

// The buckets of layers whose gradients are summed together, given each layer's gradient bytes
// (0: no gradients): consecutive layers with gradients, from the last layer to the first (the order
// backward jobs hand them over), each bucket closed once it holds kGradientBucketBytes (the last
// may hold less). The same on every rank: they depend on the model alone.
std::vector<std::vector<int>> gradient_buckets(const std::vector<std::size_t>& layer_bytes);

// Rank `root`'s `text` on every rank.
void broadcast_string(Collective& ranks, std::string& text, int root, const std::string& what);

// Where this process stands among the ranks: the CLI fills it from the launcher's variables
// (cli/rank_env.h) or its command line.
struct RankEnv {
  int rank = 0, world = 1, local_rank = 0;
  int local_world = 1;  // ranks on this node (torchrun's LOCAL_WORLD_SIZE), when the launcher says
  std::string master_addr = "127.0.0.1";
  int master_port = 29500;
  // The launcher already serves the store (torchrun's agent): rank 0 joins it as
  // a client instead of serving one.
  bool agent_store = false;
  int restart_count = 0;  // the launcher's attempt (each attempt's store keys are its own)
  std::string launcher;   // "torchrun", "slurm" or "command line", for messages
};

struct DistributedSettings {
  std::string backend = "gloo";  // the only one: gradients live in host memory
  double timeout_s = 600;        // a collective (or the rendezvous) that waits longer fails
  // Where a rank works alone for long (loading the model, rank 0 writing a checkpoint or samples),
  // the others wait at a meeting (Ranks::meet) up to this long.
  double meet_timeout_s = 7200;
  std::string interface;  // network interface for Gloo ("" = the master's route)
};

// The run's ranks: two groups over one rendezvous, so that two threads may each issue their own
// collectives in their own order. `steps` is the main thread's (each step's target count, resume
// agreement), `gradients` the optimizer thread's (gradients, loss sums).
class Ranks {
 public:
  virtual ~Ranks() = default;
  // Meets the other ranks at env.master_addr:env.master_port (rank 0 serves the store unless
  // torchrun's agent does). Throws Error when they do not all arrive within settings.timeout_s.
  static std::unique_ptr<Ranks> connect(const RankEnv& env, const DistributedSettings& settings);
  virtual Collective& steps() = 0;
  virtual Collective& gradients() = 0;
  // Every rank arrives here before any goes on (`what`, e.g. "the model loaded", for errors).
  // Through the rendezvous store, not the collectives: it waits up to meet_timeout_s, as long as a
  // rank may take to load a model or write a checkpoint alone. Call from the main thread, between
  // steps, in the same order on every rank.
  virtual void meet(const std::string& what) = 0;
  // Rank 0's `ok` on every rank (rank 0 passes its own; the others' is ignored), the others waiting
  // for it as meet() waits: whether rank 0 accepted something only it checks.
  virtual bool rank_0_says(const std::string& what, bool ok) = 0;
  virtual int rank() const = 0;
  virtual int size() const = 0;
};

}  // namespace rondo::engine
