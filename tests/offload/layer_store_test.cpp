// LayerStore: per-layer regions laid out as documented, tied tensors shared but with their own
// gradient, accounting by purpose, errors for inconsistent descriptions, and parts on the NVMe
// tier reached through access() (read, prefetched, written back) byte for byte.
#include "offload/layer_store.h"

#include <gtest/gtest.h>

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <filesystem>
#include <map>
#include <random>
#include <set>
#include <thread>

#include "kernels/cpu/adamw8bit.h"
#include "offload/nvme_store.h"

namespace fs = std::filesystem;

namespace rondo::offload {
namespace {

using kernels::FloatDType;

std::vector<LayerDesc> model(bool train_embedding) {
  return {
      {{{"embed", 22 * 7, train_embedding, -1}}},
      {{{"norm", 7, true, -1}, {"q", 7 * 7, true, -1}, {"frozen", 4097, false, -1}}},
      {{{"final_norm", 7, true, -1}, {"embed", 22 * 7, train_embedding, 0}}},
  };
}

std::size_t up64(std::size_t n) {
  return (n + 63) / 64 * 64;
}

TEST(LayerStore, RegionsAreAlignedDisjointAndAccounted) {
  HostArena arena({.pinning = Pinning::kOff});
  LayerStore store(arena, model(true), FloatDType::kBF16, FloatDType::kF32);
  ASSERT_EQ(store.layers(), 3u);
  // Fill every streaming copy and gradient with its own byte, then check none was overwritten.
  std::set<const void*> streams, grads;
  int tag = 1;
  for (std::size_t l = 0; l < store.layers(); ++l)
    for (const TensorState& t : store.layer(l)) {
      EXPECT_EQ(reinterpret_cast<std::uintptr_t>(t.stream) % 64, 0u) << t.name;
      if (!t.tied) {
        EXPECT_TRUE(streams.insert(t.stream).second);
        std::memset(t.stream, tag, t.numel * 2);
      }
      if (t.trainable) {
        ASSERT_NE(t.grad, nullptr);
        EXPECT_TRUE(grads.insert(t.grad).second) << t.name;  // tied ones too: their own
        std::memset(t.grad, tag + 100, t.numel * 4);
        ASSERT_NE(t.master, nullptr);
        if (!t.tied) {  // a tied tensor's master is its owner's
          t.master[t.numel - 1] = static_cast<float>(tag);
          t.v[0] = static_cast<float>(-tag);
        }
      }
      ++tag;
    }
  tag = 1;
  for (std::size_t l = 0; l < store.layers(); ++l)
    for (const TensorState& t : store.layer(l)) {
      auto* s = static_cast<const std::uint8_t*>(t.stream);
      if (!t.tied) {
        EXPECT_EQ(s[t.numel * 2 - 1], tag) << t.name;
      }
      if (t.trainable) {
        EXPECT_EQ(static_cast<const std::uint8_t*>(t.grad)[t.numel * 4 - 1], tag + 100) << t.name;
        if (!t.tied) {
          EXPECT_EQ(t.master[t.numel - 1], static_cast<float>(tag)) << t.name;
        }
      }
      ++tag;
    }
  // The head's embedding is the prefix's: same streaming copy and master.
  const TensorState& owner = store.tensor(0, "embed");
  const TensorState& tied = store.tensor(2, "embed");
  EXPECT_TRUE(tied.tied);
  EXPECT_EQ(tied.stream, owner.stream);
  EXPECT_EQ(tied.master, owner.master);
  EXPECT_NE(tied.grad, owner.grad);

  // Bytes by purpose, from the layout rule: 64-byte aligned tensors.
  const std::size_t e = 22 * 7;
  HostUsage u = arena.usage();
  EXPECT_EQ(u[Purpose::kWeights].bytes,
            up64(e * 2) + up64(7 * 2) + up64(49 * 2) + up64(4097 * 2) + up64(7 * 2));
  EXPECT_EQ(u[Purpose::kGradients].bytes,
            up64(e * 4) + up64(7 * 4) + up64(49 * 4) + up64(7 * 4) + up64(e * 4));
  EXPECT_EQ(u[Purpose::kOptimizerState].bytes,
            3 * (up64(e * 4) + up64(7 * 4) + up64(49 * 4) + up64(7 * 4)));
  // A layer's two streaming regions cover exactly its own tensors: the frozen ones, the trained.
  EXPECT_EQ(store.stream_bytes(1, kStreamPart).bytes, up64(7 * 2) + up64(49 * 2));
  EXPECT_EQ(store.stream_bytes(1, kBasePart).bytes, up64(4097 * 2));
  EXPECT_EQ(store.stream_bytes(1, kStreamPart).data, store.layer(1)[0].stream);
  EXPECT_EQ(store.stream_bytes(1, kBasePart).data, store.layer(1)[2].stream);
  // The tied embedding is the prefix's.
  EXPECT_EQ(store.stream_bytes(2, kStreamPart).bytes, up64(7 * 2));
  EXPECT_EQ(store.stream_bytes(2, kBasePart).bytes, 0u);
}

TEST(LayerStore, FrozenTensorsHaveNoOptimizerState) {
  HostArena arena({.pinning = Pinning::kOff});
  LayerStore store(arena, model(false), FloatDType::kBF16, FloatDType::kBF16);
  const TensorState& f = store.tensor(1, "frozen");
  EXPECT_EQ(f.master, nullptr);
  EXPECT_EQ(f.grad, nullptr);
  EXPECT_EQ(store.tensor(2, "embed").grad, nullptr);
  EXPECT_EQ(store.grad_bytes(0).bytes, 0u);
}

TEST(LayerStore, OptimizerStateElsewhereIsReadFromTheStoreThatHoldsIt) {
  // Sharded optimizer state: the second store holds layer 1's masters and moments nowhere and
  // reads them, chunk by chunk, as the first (their owner) packs them.
  for (MomentFormat format : {MomentFormat::kF32, MomentFormat::kBlockwise8}) {
    SCOPED_TRACE(to_string(format));
    std::vector<LayerDesc> whole(2);
    whole[0].tensors = {{"a", 2000, true, -1}};
    whole[1].tensors = {{"b", 1500, true, -1}, {"f", 100, false, -1}, {"c", 300, true, -1}};
    for (LayerDesc& d : whole)
      d.moments = format;
    std::vector<LayerDesc> sharded = whole;
    sharded[1].optimizer_elsewhere = true;
    const std::uint64_t chunk_bytes = (format == MomentFormat::kF32 ? 12 : 6) * 512;
    HostArena owner_arena({.pinning = Pinning::kOff}), arena({.pinning = Pinning::kOff});
    LayerStore owner(owner_arena, whole, FloatDType::kBF16, FloatDType::kF32, nullptr, chunk_bytes);
    LayerStore store(arena, sharded, FloatDType::kBF16, FloatDType::kF32, nullptr, chunk_bytes);
    // Only layer 0's state is allocated; the layer's streaming copies and gradients are there.
    EXPECT_TRUE(store.holds_optimizer(0));
    EXPECT_FALSE(store.holds_optimizer(1));
    EXPECT_EQ(arena.usage()[Purpose::kOptimizerState].bytes,
              LayerStore::host_bytes(sharded, FloatDType::kBF16, FloatDType::kF32).optimizer);
    EXPECT_EQ(LayerStore::part_bytes(sharded, 1, FloatDType::kBF16)[2], 0u);
    EXPECT_LT(arena.usage()[Purpose::kOptimizerState].bytes,
              owner_arena.usage()[Purpose::kOptimizerState].bytes);
    EXPECT_EQ(store.tensor(1, "b").master, nullptr);
    EXPECT_NE(store.tensor(1, "b").stream, nullptr);
    EXPECT_NE(store.tensor(1, "b").grad, nullptr);
    ASSERT_EQ(store.optimizer_chunks(1), owner.optimizer_chunks(1));
    ASSERT_GT(store.optimizer_chunks(1), 2u);
    // Without a way to reach the owner, or for writing, its state cannot be opened.
    EXPECT_THROW(store.access_chunk(1, 0, AccessMode::kRead), Error);
    EXPECT_THROW(store.access(1, kOptimizerPart, AccessMode::kRead), Error);
    // The owner's state, every byte its own.
    std::mt19937 rng(7);
    for (std::size_t k = 0; k < owner.optimizer_chunks(1); ++k) {
      const LayerAccess a = owner.access_chunk(1, k, AccessMode::kReadWrite);
      for (std::size_t i = 0; i < a.size(); ++i) {
        const TensorState& t = a[i];
        for (std::size_t e = 0; e < t.numel; ++e) {
          t.master[e] = static_cast<float>(rng() % 100000);
          if (t.m) {
            t.m[e] = static_cast<float>(rng() % 1000);
            t.v[e] = static_cast<float>(rng() % 1000);
          } else {
            t.m_codes[e] = static_cast<std::uint8_t>(rng());
            t.v_codes[e] = static_cast<std::uint8_t>(rng());
          }
        }
        if (t.m_absmax)
          for (std::size_t b = 0; b < kernels::adamw8bit_blocks(t.numel); ++b) {
            t.m_absmax[b] = static_cast<float>(rng() % 77);
            t.v_absmax[b] = static_cast<float>(rng() % 77);
          }
      }
    }
    int fetched = 0;
    store.set_chunk_fetch([&](std::size_t layer, std::size_t chunk, std::uint8_t* record) {
      ++fetched;
      const HostBuffer packed = owner.pack_chunk(layer, chunk);
      std::memcpy(record, packed.data(), store.chunk_bytes(layer, chunk));
    });
    EXPECT_THROW(store.access_chunk(1, 0, AccessMode::kReadWrite), Error);
    for (std::size_t k = 0; k < owner.optimizer_chunks(1); ++k) {
      const LayerAccess want = owner.access_chunk(1, k, AccessMode::kRead);
      const LayerAccess got = store.access_chunk(1, k, AccessMode::kRead);
      ASSERT_EQ(got.size(), want.size());
      for (std::size_t i = 0; i < got.size(); ++i) {
        const TensorState &g = got[i], &w = want[i];
        ASSERT_EQ(g.numel, w.numel);
        EXPECT_EQ(got.piece(i).begin, want.piece(i).begin);
        EXPECT_EQ(std::memcmp(g.master, w.master, g.numel * 4), 0) << "chunk " << k;
        if (w.m) {
          EXPECT_EQ(std::memcmp(g.m, w.m, g.numel * 4), 0);
          EXPECT_EQ(std::memcmp(g.v, w.v, g.numel * 4), 0);
        } else {
          const std::size_t nb = kernels::adamw8bit_blocks(g.numel);
          EXPECT_EQ(std::memcmp(g.m_codes, w.m_codes, g.numel), 0);
          EXPECT_EQ(std::memcmp(g.v_codes, w.v_codes, g.numel), 0);
          EXPECT_EQ(std::memcmp(g.m_absmax, w.m_absmax, nb * 4), 0);
          EXPECT_EQ(std::memcmp(g.v_absmax, w.v_absmax, nb * 4), 0);
        }
      }
    }
    EXPECT_EQ(fetched, static_cast<int>(owner.optimizer_chunks(1)));
    EXPECT_EQ(arena.usage()[Purpose::kStaging].bytes, 0u);  // each fetched record given back
  }
}

TEST(LayerStore, InconsistentDescriptionsAreRefused) {
  HostArena arena({.pinning = Pinning::kOff});
  auto later = model(true);
  later[0].tensors[0].tied_to_layer = 2;
  EXPECT_THROW(LayerStore(arena, later, FloatDType::kBF16, FloatDType::kF32), Error);
  auto missing = model(true);
  missing[2].tensors[1].name = "nope";
  try {
    LayerStore(arena, missing, FloatDType::kBF16, FloatDType::kF32);
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("'nope'"), std::string::npos) << e.what();
  }
  auto twice = model(true);
  twice[1].tensors[1].name = "norm";
  EXPECT_THROW(LayerStore(arena, twice, FloatDType::kBF16, FloatDType::kF32), Error);
}

// ---- the NVMe tier ----

struct LayerStoreNvme : ::testing::Test {
  fs::path dir = fs::temp_directory_path() / ("rondo-store-test-" + std::to_string(::getpid()));
  void SetUp() override { fs::create_directories(dir); }
  void TearDown() override { fs::remove_all(dir); }
  NvmeStoreOptions options() const {
    return {.dir = (dir / "nvme").string(), .backend = BackendKind::kThreads};
  }
};

// Layers 1 and 2 wholly on NVMe; 0 and 3 (tied) in host memory.
std::vector<LayerDesc> offloaded() {
  std::vector<LayerDesc> l = {
      {{{"embed", 22 * 7, true, -1}}},
      {{{"norm", 7, true, -1}, {"q", 7 * 7, true, -1}, {"frozen", 4097, false, -1}}},
      {{{"norm2", 7, true, -1}, {"frozen2", 3001, false, -1}}},
      {{{"final_norm", 7, true, -1}, {"embed", 22 * 7, true, 0}}},
  };
  for (int i : {1, 2})
    l[i].base = l[i].weights = l[i].optimizer = Tier::kNvme;
  return l;
}

TEST_F(LayerStoreNvme, PartsOnNvmeRoundTripThroughAccess) {
  std::mt19937 rng(std::random_device{}());
  HostArena arena({.pinning = Pinning::kOff});
  const std::vector<LayerDesc> desc = offloaded();
  NvmeStore nvme(options(), LayerStore::nvme_bytes(desc, FloatDType::kBF16));
  LayerStore store(arena, desc, FloatDType::kBF16, FloatDType::kF32, &nvme);
  // Host views of NVMe parts are absent; the host keeps only layers 0 and 3 (and gradients).
  EXPECT_EQ(store.layer(1)[0].master, nullptr);
  EXPECT_EQ(store.layer(1)[2].stream, nullptr);
  EXPECT_EQ(store.tier(1, kBasePart), Tier::kNvme);
  const LayerStore::HostBytes hb =
      LayerStore::host_bytes(desc, FloatDType::kBF16, FloatDType::kF32);
  EXPECT_EQ(arena.usage()[Purpose::kWeights].bytes, hb.weights);
  EXPECT_EQ(hb.weights, up64(22 * 7 * 2) + up64(7 * 2));
  EXPECT_EQ(hb.optimizer, 3 * (up64(22 * 7 * 4) + up64(7 * 4)));

  // Write every part of every layer through access(), then read it back.
  std::uniform_int_distribution<int> byte(0, 255);
  std::map<std::pair<std::size_t, std::size_t>, std::vector<std::uint8_t>> stream, master, v;
  for (std::size_t l = 0; l < store.layers(); ++l) {
    LayerAccess a = store.access(l, kAllParts, AccessMode::kOverwrite);
    for (std::size_t i = 0; i < a.size(); ++i) {
      const TensorState& t = a[i];
      if (t.tied) continue;
      auto& s = stream[{l, i}];
      s.resize(t.numel * 2);
      for (auto& b : s)
        b = static_cast<std::uint8_t>(byte(rng));
      std::memcpy(t.stream, s.data(), s.size());
      if (!t.trainable) continue;
      auto& m = master[{l, i}];
      m.resize(t.numel * 4);
      for (auto& b : m)
        b = static_cast<std::uint8_t>(byte(rng));
      std::memcpy(t.master, m.data(), m.size());
      auto& vv = v[{l, i}];
      vv.resize(t.numel * 4);
      for (auto& b : vv)
        b = static_cast<std::uint8_t>(byte(rng));
      std::memcpy(t.v, vv.data(), vv.size());
    }
  }
  store.flush();
  auto check = [&](unsigned parts) {
    for (std::size_t l = 0; l < store.layers(); ++l) {
      const LayerAccess a = store.access(l, parts, AccessMode::kRead);
      for (std::size_t i = 0; i < a.size(); ++i) {
        const TensorState& t = a[i];
        if (t.tied) continue;
        if (parts & stream_part(t)) {
          EXPECT_EQ(std::memcmp(t.stream, stream[{l, i}].data(), t.numel * 2), 0) << l << i;
        }
        if (t.trainable && (parts & kOptimizerPart)) {
          EXPECT_EQ(std::memcmp(t.master, master[{l, i}].data(), t.numel * 4), 0) << l << i;
          EXPECT_EQ(std::memcmp(t.v, v[{l, i}].data(), t.numel * 4), 0) << l << i;
        }
      }
    }
  };
  check(kAllParts);
  // Prefetched reads give the same; a read-modify-write is seen by the next access.
  for (std::size_t l = 0; l < store.layers(); ++l)
    store.prefetch(l, kAllParts);
  check(kBasePart);
  check(kOptimizerPart);
  {
    LayerAccess a = store.access(2, kOptimizerPart, AccessMode::kReadWrite);
    a[0].m[3] = 42.5f;
  }
  {
    const LayerAccess a = store.access(2, kOptimizerPart, AccessMode::kRead);  // from the write
    EXPECT_EQ(a[0].m[3], 42.5f);
  }
  store.flush();
  {
    const LayerAccess a = store.access(2, kOptimizerPart, AccessMode::kRead);  // from the drive
    EXPECT_EQ(a[0].m[3], 42.5f);
  }
  // Staging is returned when accesses end.
  EXPECT_EQ(arena.usage()[Purpose::kStaging].bytes, 0u);
}

// 8-bit moments (MomentFormat::kBlockwise8): per trained tensor n codes of each moment and an
// absmax per block of 256 elements, no f32 moments; regions disjoint inside the optimizer part, in
// host memory and on the NVMe tier, accounted at 4 + 2 bytes per element plus 8 per block.
TEST_F(LayerStoreNvme, EightBitMomentsAreLaidOutAndRoundTrip) {
  std::vector<LayerDesc> desc = offloaded();
  desc[1].tensors[1].numel = 70001;  // 274 blocks, the last partial
  for (LayerDesc& d : desc)
    d.moments = MomentFormat::kBlockwise8;
  HostArena arena({.pinning = Pinning::kOff});
  NvmeStore nvme(options(), LayerStore::nvme_bytes(desc, FloatDType::kBF16));
  LayerStore store(arena, desc, FloatDType::kBF16, FloatDType::kF32, &nvme);
  EXPECT_EQ(store.moments(1), MomentFormat::kBlockwise8);
  // Host layers 0 and 3: one owned trained tensor (embed) and final_norm.
  const LayerStore::HostBytes hb =
      LayerStore::host_bytes(desc, FloatDType::kBF16, FloatDType::kF32);
  const std::size_t embed = up64(22 * 7 * 4) / 4, norm = up64(7 * 4) / 4;  // f32 elements
  const std::size_t blocks = 2 * (up64(1 * 4) / 4);                        // one block each
  EXPECT_EQ(hb.masters, (embed + norm) * 4);
  EXPECT_EQ(hb.optimizer, (embed + norm) * (4 + 2) + 2 * blocks * 4);
  EXPECT_EQ(arena.usage()[Purpose::kOptimizerState].bytes, hb.optimizer);
  for (std::size_t l = 0; l < store.layers(); ++l) {
    LayerAccess a = store.access(l, kOptimizerPart, AccessMode::kOverwrite);
    std::vector<std::pair<const std::uint8_t*, std::size_t>> spans;
    for (std::size_t i = 0; i < a.size(); ++i) {
      const TensorState& t = a[i];
      if (!t.trainable || t.tied) continue;
      EXPECT_EQ(t.m, nullptr);
      EXPECT_EQ(t.v, nullptr);
      ASSERT_NE(t.m_codes, nullptr);
      const std::size_t nb = (t.numel + 255) / 256;
      spans.push_back({reinterpret_cast<const std::uint8_t*>(t.master), t.numel * 4});
      spans.push_back({t.m_codes, t.numel});
      spans.push_back({t.v_codes, t.numel});
      spans.push_back({reinterpret_cast<const std::uint8_t*>(t.m_absmax), nb * 4});
      spans.push_back({reinterpret_cast<const std::uint8_t*>(t.v_absmax), nb * 4});
      // Fresh state: all zero (m = v = 0 as bitsandbytes starts).
      for (std::size_t k = 0; k < t.numel; ++k)
        ASSERT_EQ(t.m_codes[k] | t.v_codes[k], 0) << t.name;
      for (std::size_t k = 0; k < t.numel; ++k) {
        t.master[k] = static_cast<float>(l * 1000 + k);
        t.m_codes[k] = static_cast<std::uint8_t>(k * 7 + l);
        t.v_codes[k] = static_cast<std::uint8_t>(k * 13 + l);
      }
      for (std::size_t b = 0; b < nb; ++b) {
        t.m_absmax[b] = static_cast<float>(b) + 0.5f;
        t.v_absmax[b] = static_cast<float>(b) + 0.25f;
      }
    }
    std::sort(spans.begin(), spans.end());
    for (std::size_t k = 1; k < spans.size(); ++k)
      EXPECT_LE(spans[k - 1].first + spans[k - 1].second, spans[k].first) << "layer " << l;
  }
  store.flush();
  for (std::size_t l = 0; l < store.layers(); ++l) {
    const LayerAccess a = store.access(l, kOptimizerPart, AccessMode::kRead);
    for (std::size_t i = 0; i < a.size(); ++i) {
      const TensorState& t = a[i];
      if (!t.trainable || t.tied) continue;
      for (std::size_t k = 0; k < t.numel; ++k) {
        ASSERT_EQ(t.master[k], static_cast<float>(l * 1000 + k)) << t.name;
        ASSERT_EQ(t.m_codes[k], static_cast<std::uint8_t>(k * 7 + l)) << t.name;
        ASSERT_EQ(t.v_codes[k], static_cast<std::uint8_t>(k * 13 + l)) << t.name;
      }
      for (std::size_t b = 0; b < (t.numel + 255) / 256; ++b) {
        ASSERT_EQ(t.m_absmax[b], static_cast<float>(b) + 0.5f) << t.name;
        ASSERT_EQ(t.v_absmax[b], static_cast<float>(b) + 0.25f) << t.name;
      }
    }
  }
  // The tied embedding views its owner's 8-bit state.
  EXPECT_EQ(store.layer(3)[1].m_codes, store.layer(0)[0].m_codes);
  EXPECT_EQ(store.layer(3)[1].v_absmax, store.layer(0)[0].v_absmax);
}

// One writer updating a part in place while readers (and prefetches) read it, as a device's
// loaders read a layer the optimizer has just written: every read sees one whole version (never a
// mix of two, never a read overtaking a write-back), and versions only move forward.
// Optimizer chunks (Note [Optimizer chunks]): tensors cut at the grain into chunks of at most
// the chunk size, every trained element in exactly one piece, in order; a chunk's views are the
// tensor's elements (in place for host memory, staged for NVMe), and what a chunk access writes
// is what a layer access reads, and back, in both moment formats.
TEST_F(LayerStoreNvme, OptimizerChunksCutTensorsAndRoundTrip) {
  for (MomentFormat format : {MomentFormat::kF32, MomentFormat::kBlockwise8}) {
    SCOPED_TRACE(to_string(format));
    const std::size_t per_element = format == MomentFormat::kF32 ? 12 : 6;
    std::vector<LayerDesc> desc(2);
    for (LayerDesc& d : desc) {
      d.tensors = {{"a", 2000, true, -1}, {"frozen", 100, false, -1}, {"b", 500, true, -1}};
      d.moments = format;
    }
    desc[1].base = desc[1].weights = desc[1].optimizer = Tier::kNvme;
    const std::uint64_t chunk_bytes = per_element * 800;  // 800 elements: 768 after the grain
    // By the rule: a in [0,768) [768,1536) and [1536,2000) (464); then 304 elements of room for
    // b, cut on the grain to 256, which join a's tail; b's other 244 make the last chunk.
    const std::vector<std::vector<OptimizerPiece>> want = {
        {{0, 0, 768}}, {{0, 768, 768}}, {{0, 1536, 464}, {2, 0, 256}}, {{2, 256, 244}}};
    const auto chunks = LayerStore::chunks_of(desc[0], chunk_bytes);
    ASSERT_EQ(chunks.size(), want.size());
    for (std::size_t k = 0; k < want.size(); ++k) {
      ASSERT_EQ(chunks[k].size(), want[k].size()) << "chunk " << k;
      std::size_t elements = 0;
      for (std::size_t i = 0; i < want[k].size(); ++i) {
        EXPECT_EQ(chunks[k][i].tensor, want[k][i].tensor);
        EXPECT_EQ(chunks[k][i].begin, want[k][i].begin);
        EXPECT_EQ(chunks[k][i].numel, want[k][i].numel);
        EXPECT_EQ(chunks[k][i].begin % kChunkGrain, 0u);
        elements += chunks[k][i].numel;
      }
      EXPECT_LE(elements * per_element, chunk_bytes);
    }
    HostArena arena({.pinning = Pinning::kOff});
    NvmeStore nvme(options(), LayerStore::nvme_bytes(desc, FloatDType::kBF16, chunk_bytes));
    LayerStore store(arena, desc, FloatDType::kBF16, FloatDType::kF32, &nvme, chunk_bytes);
    ASSERT_EQ(store.optimizer_chunks(1), want.size());
    // Every element a value of its own, through layer accesses.
    auto value = [](std::size_t l, std::size_t i, std::size_t k, int what) {
      return static_cast<float>(l * 100000 + i * 10000 + k) + 0.25f * static_cast<float>(what);
    };
    for (std::size_t l = 0; l < 2; ++l) {
      LayerAccess a = store.access(l, kOptimizerPart, AccessMode::kOverwrite);
      for (std::size_t i : {0u, 2u}) {
        const TensorState& t = a[i];
        for (std::size_t k = 0; k < t.numel; ++k) {
          t.master[k] = value(l, i, k, 0);
          if (t.m) {
            t.m[k] = value(l, i, k, 1);
            t.v[k] = value(l, i, k, 2);
          } else {
            t.m_codes[k] = static_cast<std::uint8_t>(k * 7 + i + l);
            t.v_codes[k] = static_cast<std::uint8_t>(k * 13 + i + l);
          }
        }
        for (std::size_t b = 0; t.m_absmax && b < (t.numel + 255) / 256; ++b) {
          t.m_absmax[b] = value(l, i, b, 3);
          t.v_absmax[b] = value(l, i, b, 4);
        }
      }
    }
    // Chunk by chunk: each piece sees its elements; then each is changed through the chunk.
    for (std::size_t l = 0; l < 2; ++l)
      for (std::size_t c = 0; c < store.optimizer_chunks(l); ++c) {
        if (c + 1 < store.optimizer_chunks(l)) store.prefetch_chunk(l, c + 1);
        const LayerAccess a = store.access_chunk(l, c, AccessMode::kReadWrite);
        ASSERT_EQ(a.size(), want[c].size());
        for (std::size_t p = 0; p < a.size(); ++p) {
          const OptimizerPiece& piece = a.piece(p);
          const TensorState& v = a[p];
          ASSERT_EQ(v.numel, piece.numel);
          if (l == 0) {  // host memory: in place
            EXPECT_EQ(v.master, store.layer(0)[piece.tensor].master + piece.begin);
          }
          for (std::size_t k = 0; k < v.numel; ++k) {
            const std::size_t e = piece.begin + k;
            ASSERT_EQ(v.master[k], value(l, piece.tensor, e, 0)) << l << " " << c << " " << k;
            v.master[k] += 1;
            if (v.m) {
              ASSERT_EQ(v.m[k], value(l, piece.tensor, e, 1));
              ASSERT_EQ(v.v[k], value(l, piece.tensor, e, 2));
              v.v[k] += 2;
            } else {
              ASSERT_EQ(v.m_codes[k], static_cast<std::uint8_t>(e * 7 + piece.tensor + l));
              ASSERT_EQ(v.v_codes[k], static_cast<std::uint8_t>(e * 13 + piece.tensor + l));
              v.v_codes[k] ^= 0xff;
            }
          }
          for (std::size_t b = 0; v.m_absmax && b < (v.numel + 255) / 256; ++b) {
            ASSERT_EQ(v.m_absmax[b], value(l, piece.tensor, piece.begin / 256 + b, 3));
            v.v_absmax[b] += 4;
          }
        }
      }
    store.flush();
    for (std::size_t l = 0; l < 2; ++l) {
      const LayerAccess a = store.access(l, kOptimizerPart, AccessMode::kRead);
      for (std::size_t i : {0u, 2u}) {
        const TensorState& t = a[i];
        for (std::size_t k = 0; k < t.numel; ++k) {
          ASSERT_EQ(t.master[k], value(l, i, k, 0) + 1) << l << " " << i << " " << k;
          if (t.m) {
            ASSERT_EQ(t.v[k], value(l, i, k, 2) + 2);
          } else {
            ASSERT_EQ(t.v_codes[k], static_cast<std::uint8_t>((k * 13 + i + l) ^ 0xff));
          }
        }
        for (std::size_t b = 0; t.m_absmax && b < (t.numel + 255) / 256; ++b)
          ASSERT_EQ(t.v_absmax[b], value(l, i, b, 4) + 4);
      }
    }
    // Staging while a chunk is open: the chunk's record, not the layer's state.
    const LayerAccess one = store.access_chunk(1, 0, AccessMode::kRead);
    EXPECT_LE(arena.usage()[Purpose::kStaging].bytes, 2 * store.max_chunk_bytes());
  }
}

// Gradients on NVMe (Note [Gradients on NVMe] in transfer.cpp): no host memory, a record per
// optimizer chunk holding the chunk's pieces' gradients back to back; written record by record,
// read back with their chunk by the optimizer's access (and only then), in place where the layer
// keeps its gradients in host memory.
TEST_F(LayerStoreNvme, GradientRecordsFollowTheChunks) {
  for (FloatDType gd : {FloatDType::kF32, FloatDType::kBF16}) {
    SCOPED_TRACE(kernels::to_string(gd));
    const std::size_t gs = kernels::dtype_size(gd);
    std::vector<LayerDesc> desc(2);
    for (LayerDesc& d : desc)
      d.tensors = {{"a", 2000, true, -1}, {"frozen", 100, false, -1}, {"b", 500, true, -1}};
    desc[1].grads = Tier::kNvme;
    const std::uint64_t chunk_bytes = 12 * 800;  // the chunks of OptimizerChunksCutTensors...
    HostArena arena({.pinning = Pinning::kOff});
    NvmeStore nvme(options(), LayerStore::nvme_bytes(desc, FloatDType::kF32, chunk_bytes));
    LayerStore store(arena, desc, FloatDType::kF32, gd, &nvme, chunk_bytes);
    EXPECT_EQ(LayerStore::host_bytes(desc, FloatDType::kF32, gd).gradients,
              store.grad_bytes(0).bytes);
    EXPECT_EQ(store.grad_tier(1), Tier::kNvme);
    EXPECT_EQ(store.grad_bytes(1).data, nullptr);
    EXPECT_EQ(store.grad_bytes(1).bytes, store.grad_bytes(0).bytes);
    EXPECT_EQ(store.layer(1)[0].grad, nullptr);
    EXPECT_EQ(store.layer(1)[2].grad_offset, store.layer(0)[2].grad_offset);
    ASSERT_EQ(store.optimizer_chunks(1), 4u);
    // Each element's gradient: a function of tensor and index.
    auto value = [&](std::size_t tensor, std::size_t i) {
      return static_cast<std::uint8_t>((tensor * 37 + i * 11) % 251);
    };
    for (std::size_t k = 0; k < 4; ++k) {
      std::uint64_t want = 0;
      for (const OptimizerPiece& p : store.optimizer_chunk(1, k))
        want += p.numel * gs;
      EXPECT_EQ(store.grad_record_bytes(1, k), want);
      HostBuffer r = store.grad_record(1, k);
      std::size_t at = 0;
      for (const OptimizerPiece& p : store.optimizer_chunk(1, k))
        for (std::size_t i = 0; i < p.numel * gs; ++i)
          r.as<std::uint8_t>()[at++] = value(p.tensor, p.begin * gs + i);
      store.write_grad_record(1, k, std::move(r));
    }
    // Host layer 0: the chunk views point into the layer's gradient region.
    {
      const LayerAccess a = store.access_chunk(0, 2, AccessMode::kRead, /*grads=*/true);
      EXPECT_EQ(a[1].grad, static_cast<std::uint8_t*>(store.layer(0)[2].grad));
      EXPECT_EQ(store.access_chunk(0, 2, AccessMode::kRead)[1].grad, nullptr);
    }
    for (int pass = 0; pass < 2; ++pass) {  // while the writes are in flight, then from the drive
      for (std::size_t k = 0; k < 4; ++k) {
        if (k + 1 < 4) store.prefetch_chunk(1, k + 1, /*grads=*/true);
        const LayerAccess a = store.access_chunk(1, k, AccessMode::kReadWrite, /*grads=*/true);
        for (std::size_t i = 0; i < a.size(); ++i) {
          const auto* g = static_cast<const std::uint8_t*>(a[i].grad);
          ASSERT_NE(g, nullptr);
          for (std::size_t j = 0; j < a[i].numel * gs; ++j)
            ASSERT_EQ(g[j], value(a.piece(i).tensor, a.piece(i).begin * gs + j))
                << "chunk " << k << " piece " << i << " byte " << j;
        }
      }
      store.flush();
    }
  }
}

// Weight pieces (Note [Weight pieces]): a streaming part on NVMe loaded piece by piece reads back
// piece by piece as written, whatever the piece's size against the part's; a piece read ahead of
// a rewrite of the part is dropped, and the read after it sees the new bytes.
TEST_F(LayerStoreNvme, WeightPiecesLoadAndReadAsWritten) {
  std::vector<LayerDesc> desc(1);
  desc[0].tensors = {{"frozen", 700001, false, -1}, {"trained", 300007, true, -1}};
  desc[0].base = desc[0].weights = Tier::kNvme;
  const std::uint64_t chunk = 1 << 20;  // pieces of one 1 MiB block
  HostArena arena({.pinning = Pinning::kOff});
  NvmeStore nvme(options(), LayerStore::nvme_bytes(desc, FloatDType::kF32, chunk));
  LayerStore store(arena, desc, FloatDType::kF32, FloatDType::kF32, &nvme, chunk);
  ASSERT_EQ(store.piece_bytes(), 1u << 20);
  // 700001 * 4 bytes: 3 pieces (the last 0.67 MiB); 300007 * 4: 2.
  EXPECT_EQ(store.pieces(0, kBasePart), 3u);
  EXPECT_EQ(store.pieces(0, kStreamPart), 2u);
  auto byte = [](unsigned part, std::size_t k, int version) {
    return static_cast<std::uint8_t>(k * 31 + part * 7 + version);
  };
  for (unsigned part : {kBasePart, kStreamPart})
    for (std::size_t i = 0; i < store.pieces(0, part); ++i) {
      HostBuffer b = store.piece_buffer(0, part, i);
      for (std::size_t k = 0; k < b.bytes(); ++k)
        b.as<std::uint8_t>()[k] = byte(part, i * store.piece_bytes() + k, 0);
      store.write_piece(0, part, i, std::move(b));
    }
  store.flush();
  auto expect_pieces = [&](unsigned part, int version) {
    const std::size_t n = store.pieces(0, part), bytes = store.stream_bytes(0, part).bytes;
    for (std::size_t i = 0; i < n; ++i) {
      if (i + 1 < n) store.prefetch_piece(0, part, i + 1);
      const HostBuffer b = store.read_piece(0, part, i);
      const std::size_t first = i * store.piece_bytes();
      for (std::size_t k = 0; first + k < bytes && k < store.piece_bytes(); ++k)
        ASSERT_EQ(b.as<std::uint8_t>()[k], byte(part, first + k, version))
            << "part " << part << " piece " << i << " byte " << k;
    }
  };
  expect_pieces(kBasePart, 0);
  expect_pieces(kStreamPart, 0);
  // The same bytes through a layer access.
  {
    const LayerAccess a = store.access(0, kBasePart, AccessMode::kRead);
    const ByteRange r = a.stream_bytes(kBasePart);
    for (std::size_t k = 0; k < r.bytes; k += 4099)
      ASSERT_EQ(r.data[k], byte(kBasePart, k, 0)) << k;
  }
  // A piece read ahead, then the part rewritten whole (as the optimizer does): the read after
  // the rewrite sees the new bytes.
  store.prefetch_piece(0, kStreamPart, 1);
  {
    const LayerAccess a = store.access(0, kStreamPart, AccessMode::kOverwrite);
    const ByteRange r = a.stream_bytes(kStreamPart);
    for (std::size_t k = 0; k < r.bytes; ++k)
      r.data[k] = byte(kStreamPart, k, 1);
  }
  expect_pieces(kStreamPart, 1);
  store.flush();
  expect_pieces(kStreamPart, 1);
  // Rewritten in pieces through a PieceWriter (as the optimizer does), in puts that straddle the
  // pieces, with a piece read ahead of it: reads while the writes are in flight, and after them,
  // see the new bytes, piece by piece and through a layer access.
  for (int version : {2, 3}) {
    store.prefetch_piece(0, kStreamPart, 1);
    PieceWriter w(store, 0, kStreamPart);
    const std::size_t bytes = store.stream_bytes(0, kStreamPart).bytes;
    std::vector<std::uint8_t> v(bytes);
    for (std::size_t k = 0; k < bytes; ++k)
      v[k] = byte(kStreamPart, k, version);
    for (std::size_t at = 0; at < bytes; at += 333331)
      w.put(at, v.data() + at, std::min<std::size_t>(333331, bytes - at));
    w.finish();
    expect_pieces(kStreamPart, version);
  }
  {
    const LayerAccess a = store.access(0, kStreamPart, AccessMode::kRead);
    const ByteRange r = a.stream_bytes(kStreamPart);
    for (std::size_t k = 0; k < r.bytes; ++k)
      ASSERT_EQ(r.data[k], byte(kStreamPart, k, 3)) << k;
  }
  store.flush();
  expect_pieces(kStreamPart, 3);
}

TEST_F(LayerStoreNvme, ReadersNeverSeeATornOrOlderVersion) {
  HostArena arena({.pinning = Pinning::kOff});
  std::vector<LayerDesc> desc = {{{{"w", (3 << 20) / 4 + 5, true, -1}}}};  // 3 blocks and a bit
  desc[0].weights = desc[0].optimizer = Tier::kNvme;
  NvmeStore nvme(options(), LayerStore::nvme_bytes(desc, FloatDType::kF32));
  LayerStore store(arena, desc, FloatDType::kF32, FloatDType::kF32, &nvme);
  {
    LayerAccess a = store.access(0, kStreamPart, AccessMode::kOverwrite);
    std::fill_n(static_cast<float*>(a[0].stream), a[0].numel, 0.0f);
  }
  constexpr int kVersions = 40;
  std::atomic<int> written{0};
  std::atomic<bool> failed{false};
  std::thread writer([&] {
    for (int v = 1; v <= kVersions; ++v) {
      {
        LayerAccess a = store.access(0, kStreamPart, AccessMode::kReadWrite);
        auto* w = static_cast<float*>(a[0].stream);
        if (w[0] != static_cast<float>(v - 1)) failed = true;
        std::fill_n(w, a[0].numel, static_cast<float>(v));
      }
      written = v;
    }
  });
  std::vector<std::thread> readers;
  for (int t = 0; t < 3; ++t)
    readers.emplace_back([&, t] {
      float last = 0;
      while (written < kVersions && !failed) {
        if (t == 0) store.prefetch(0, kStreamPart);
        const int at_least = written;  // versions finished before this read started
        const LayerAccess a = store.access(0, kStreamPart, AccessMode::kRead);
        const auto* w = static_cast<const float*>(a[0].stream);
        const float v = w[0];
        for (std::size_t i = 0; i < a[0].numel; i += 997)
          if (w[i] != v) failed = true;  // torn
        if (w[a[0].numel - 1] != v || v < last || v < static_cast<float>(at_least)) failed = true;
        last = v;
      }
    });
  writer.join();
  for (std::thread& r : readers)
    r.join();
  EXPECT_FALSE(failed);
  store.flush();
  const LayerAccess a = store.access(0, kStreamPart, AccessMode::kRead);
  EXPECT_EQ(static_cast<const float*>(a[0].stream)[0], static_cast<float>(kVersions));
}

TEST_F(LayerStoreNvme, RefusesWhatCannotWork) {
  HostArena arena({.pinning = Pinning::kOff});
  std::vector<LayerDesc> desc = offloaded();
  try {
    LayerStore(arena, desc, FloatDType::kBF16, FloatDType::kF32);
    FAIL() << "NVMe parts without a store";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("hardware.offload_dir"), std::string::npos) << e.what();
  }
  NvmeStore nvme(options(), 1 << 20);
  desc[3].optimizer = Tier::kNvme;  // the tied head
  EXPECT_THROW(LayerStore(arena, desc, FloatDType::kBF16, FloatDType::kF32, &nvme), Error);
  std::vector<LayerDesc> q = model(true);
  q[1].tensors[1].quant = {.type = kernels::QuantType::kInt8};  // trained and quantised
  q[1].tensors[1].rows = q[1].tensors[1].cols = 7;
  EXPECT_THROW(LayerStore(arena, q, FloatDType::kBF16, FloatDType::kF32), Error);
}

}  // namespace
}  // namespace rondo::offload
