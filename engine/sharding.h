// Sharded optimizer state across the ranks of a data-parallel run (ZeRO-1 style;
// docs/distributed.md, "Sharded optimizer state"): each layer's fp32 masters and AdamW moments
// live on one rank only, its owner, which updates the layer and broadcasts the new streaming
// copies to the others; so N ranks hold 1/N of the optimizer state each. Ownership is by runs of
// consecutive layers balanced by their optimizer bytes, the same on every rank (it depends on the
// model alone). Checkpoints and exports stay whole: rank 0 reads the layers others own from them,
// chunk by chunk, while they serve its requests (with_gathered_state), so a checkpoint of a
// sharded run is the checkpoint of any run and resumes on any number of ranks, sharded or not.
//
//   std::vector<int> owners = engine::optimizer_owners(state_bytes, ranks.size());
//   engine::shard_layers(descs, owners, ranks.rank());  // before the LayerStore is made
//   engine::with_gathered_state(ranks.steps(), store, owners, [&] { write_checkpoint(...); });
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <vector>

#include "engine/ranks.h"
#include "offload/layer_store.h"

namespace rondo::engine {

// The owner of each layer's optimizer state among `ranks` ranks, given each layer's bytes of it
// (0: nothing trained, owner -1): rank 0 the first run of layers, rank 1 the next, and so on, the
// runs cut where the sum of the squares of the ranks' bytes is least (as even as whole layers
// allow: a large embedding alone on one rank, the rest shared evenly by the others).
std::vector<int> optimizer_owners(const std::vector<std::uint64_t>& state_bytes, int ranks);

// The owners of `layers`' optimizer state (their bytes as offload::LayerStore keeps them).
std::vector<int> optimizer_owners(const std::vector<offload::LayerDesc>& layers, int ranks);

// Marks the layers `rank` does not own as offload::LayerDesc::optimizer_elsewhere.
void shard_layers(std::vector<offload::LayerDesc>& layers, const std::vector<int>& owners,
                  int rank);

// Data parallel: the updated streaming copies a rank broadcasts are sent in groups of consecutive
// layers of one owner, back to back in the store, of at least this many bytes (the last of a run
// may hold less).
inline constexpr std::size_t kWeightGroupBytes = 16ull << 20;

// Every rank calls this at the same point, on the main thread. Rank 0 runs `work` (a checkpoint,
// an export), reading the layers other ranks own through `store`'s ChunkFetch: a request to the
// owner, its chunk record back (Collective::send, recv). The other ranks serve those requests
// until rank 0 says it is done, which it does even when `work` throws (then rethrown on rank 0
// alone). A rank waits for the next request up to the collective timeout (distributed.timeout).
void with_gathered_state(Collective& ranks, offload::LayerStore& store,
                         const std::vector<int>& owners, const std::function<void()>& work);

}  // namespace rondo::engine
