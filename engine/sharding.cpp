// Sharded optimizer state (sharding.h): who owns which layers, and rank 0 reading the others'.
#include "engine/sharding.h"

#include <algorithm>
#include <exception>
#include <string>

#include "kernels/error.h"

namespace rondo::engine {

std::vector<int> optimizer_owners(const std::vector<std::uint64_t>& state_bytes, int ranks) {
  RONDO_ASSERT(ranks >= 1);
  // The layers with state, in order, and their prefix sums.
  std::vector<std::size_t> with;
  for (std::size_t l = 0; l < state_bytes.size(); ++l)
    if (state_bytes[l] > 0) with.push_back(l);
  const std::size_t n = with.size();
  const auto R = static_cast<std::size_t>(ranks);
  std::vector<long double> prefix(n + 1, 0);
  for (std::size_t i = 0; i < n; ++i)
    prefix[i + 1] = prefix[i] + static_cast<long double>(state_bytes[with[i]]);
  // cost[k][i]: the least sum of squared shares of layers i.. over k ranks; cut[k][i]: where the
  // first of those k ranks stops (the longest run among equal costs, so that early ranks are the
  // ones that own something when there are more ranks than layers).
  std::vector<std::vector<long double>> cost(R + 1, std::vector<long double>(n + 1, 0));
  std::vector<std::vector<std::size_t>> cut(R + 1, std::vector<std::size_t>(n + 1, n));
  for (std::size_t i = 0; i <= n; ++i) {
    const long double rest = prefix[n] - prefix[i];
    cost[1][i] = rest * rest;
  }
  for (std::size_t k = 2; k <= R; ++k)
    for (std::size_t i = 0; i <= n; ++i) {
      cost[k][i] = -1;
      for (std::size_t j = n + 1; j-- > i;) {
        const long double share = prefix[j] - prefix[i];
        const long double c = share * share + cost[k - 1][j];
        if (cost[k][i] < 0 || c < cost[k][i]) {
          cost[k][i] = c;
          cut[k][i] = j;
        }
      }
    }
  std::vector<int> owners(state_bytes.size(), -1);
  std::size_t i = 0;
  for (std::size_t k = R; k >= 1 && i < n; --k) {
    const std::size_t end = cut[k][i];
    for (; i < end; ++i)
      owners[with[i]] = static_cast<int>(R - k);
  }
  return owners;
}

std::vector<int> optimizer_owners(const std::vector<offload::LayerDesc>& layers, int ranks) {
  std::vector<offload::LayerDesc> whole = layers;  // the bytes of every layer, held here or not
  std::vector<std::uint64_t> bytes;
  for (std::size_t l = 0; l < whole.size(); ++l) {
    whole[l].optimizer_elsewhere = false;
    bytes.push_back(offload::LayerStore::part_bytes(whole, l, kernels::FloatDType::kF32)[2]);
  }
  return optimizer_owners(bytes, ranks);
}

void shard_layers(std::vector<offload::LayerDesc>& layers, const std::vector<int>& owners,
                  int rank) {
  RONDO_ASSERT(owners.size() == layers.size());
  for (std::size_t l = 0; l < layers.size(); ++l)
    layers[l].optimizer_elsewhere = owners[l] >= 0 && owners[l] != rank;
}

void with_gathered_state(Collective& ranks, offload::LayerStore& store,
                         const std::vector<int>& owners, const std::function<void()>& work) {
  RONDO_ASSERT(owners.size() == store.layers());
  // A request: (layer, chunk); (-1, -1) ends the serving.
  std::int64_t request[2] = {-1, -1};
  if (ranks.rank() != 0) {
    for (;;) {
      ranks.recv(request, sizeof request, 0, "rank 0's next request for optimizer state");
      if (request[0] < 0) return;
      const auto layer = static_cast<std::size_t>(request[0]);
      const auto chunk = static_cast<std::size_t>(request[1]);
      RONDO_ASSERT_MSG(layer < store.layers() && store.holds_optimizer(layer) &&
                           chunk < store.optimizer_chunks(layer),
                       "rank 0 asked for optimizer state this rank does not hold");
      const offload::HostBuffer record = store.pack_chunk(layer, chunk);
      ranks.send(record.data(), store.chunk_bytes(layer, chunk), 0,
                 "the optimizer state of layer " + std::to_string(layer) + ", chunk " +
                     std::to_string(chunk + 1));
    }
  }
  store.set_chunk_fetch([&](std::size_t layer, std::size_t chunk, std::uint8_t* record) {
    const int owner = owners[layer];
    RONDO_ASSERT(owner > 0 && owner < ranks.size());
    const std::string what = "the optimizer state of layer " + std::to_string(layer) + ", chunk " +
                             std::to_string(chunk + 1) + ", from rank " + std::to_string(owner);
    std::int64_t asked[2] = {static_cast<std::int64_t>(layer), static_cast<std::int64_t>(chunk)};
    ranks.send(asked, sizeof asked, owner, what);
    ranks.recv(record, store.chunk_bytes(layer, chunk), owner, what);
  });
  std::exception_ptr failed;
  try {
    work();
  } catch (...) {
    failed = std::current_exception();
  }
  store.set_chunk_fetch({});
  for (int r = 1; r < ranks.size(); ++r)
    try {
      ranks.send(request, sizeof request, r, "the end of rank 0's requests for optimizer state");
    } catch (...) {
      if (!failed) failed = std::current_exception();
    }
  if (failed) std::rethrow_exception(failed);
}

}  // namespace rondo::engine
