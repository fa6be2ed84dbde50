// engine::load_weights from a model file, and the merged export back out of the store. Loading
// (Note [Loading in slices] in engine/model_store.cpp): a tensor stored in the streaming dtype goes
// into the store a slice at a time — a weight piece of a frozen tensor, an optimizer piece of a
// trained one — and the reader drops each slice's file pages as it is in, so loading a large
// embedding onto the NVMe tier maps about a piece of the file at a time. The store ends holding the
// file's values either way.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cctype>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>

#include "engine/export.h"
#include "engine/model_store.h"
#include "models/safetensors.h"
#include "models/weight_reader.h"
#include "offload/nvme_store.h"
#include "tests/support/tiny_model_folder.h"

namespace fs = std::filesystem;

namespace rondo::engine {
namespace {

// Resident pages of this process's mappings of `file` (their Rss in /proc/self/smaps), bytes.
std::uint64_t mapped_resident(const std::string& file) {
  std::ifstream f("/proc/self/smaps");
  std::uint64_t total = 0;
  bool in_file = false;
  for (std::string line; std::getline(f, line);) {
    if (!line.empty() && std::isxdigit(static_cast<unsigned char>(line[0])) &&
        line.find('-') != std::string::npos && line.find(' ') > line.find('-'))
      in_file = line.size() >= file.size() &&
                line.compare(line.size() - file.size(), file.size(), file) == 0;
    else if (in_file && line.rfind("Rss:", 0) == 0)
      total += std::stoull(line.substr(4)) * 1024;
  }
  return total;
}

TEST(LoadWeights, TensorsGoInASliceAtATimeAndTheirPagesAreDropped) {
  const fs::path dir =
      fs::temp_directory_path() / ("rondo-model-store-test-" + std::to_string(::getpid()));
  // An untied vocabulary of 120,000 at hidden 64: embedding and head 29.3 MiB each in f32.
  test::write_model_folder((dir / "model").string(), 3,
                           {.layers = 1, .hidden = 64, .intermediate = 128, .vocab = 120000});
  const models::WeightReader reader((dir / "model").string());
  const std::vector<models::LayerSpec>& specs = reader.layers();
  const std::uint64_t chunk = 1ull << 20;
  for (const bool full : {false, true}) {
    SCOPED_TRACE(full ? "full" : "frozen");
    std::vector<offload::LayerDesc> d =
        layer_descs(specs, [&](const models::ParamSpec&) { return full; });
    for (offload::LayerDesc& l : d)
      l.base = l.weights = l.optimizer = offload::Tier::kNvme;
    offload::HostArena arena({.pinning = offload::Pinning::kOff});
    offload::NvmeStore nvme(offload::NvmeStoreOptions{.dir = (dir / "nvme").string()},
                            offload::LayerStore::nvme_bytes(d, kernels::FloatDType::kF32, chunk));
    offload::LayerStore store(arena, d, kernels::FloatDType::kF32, kernels::FloatDType::kF32, &nvme,
                              chunk);
    // Each tensor's slices, in order; the most of the model file's pages mapped at once.
    std::map<std::string, std::vector<std::pair<std::int64_t, std::int64_t>>> slices;
    const std::string file = (dir / "model" / "model.safetensors").string();
    std::uint64_t mapped_peak = 0;
    load_weights(
        store, specs,
        WeightSource{
            .tensor = [&](const std::string& n) { return reader.read(n, models::DType::kF32); },
            .done = [&](const std::string& n) { reader.release(n); },
            .done_range =
                [&](const std::string& n, std::int64_t first, std::int64_t count) {
                  mapped_peak = std::max(mapped_peak, mapped_resident(file));
                  slices[n].push_back({first, count});
                  reader.release_range(n, first, count);
                }});
    const std::int64_t most = static_cast<std::int64_t>(store.piece_bytes() / 4);
    for (const models::LayerSpec& l : specs)
      for (const models::ParamSpec& p : l.params) {
        if (p.tied) continue;
        const auto& s = slices[p.name];
        ASSERT_FALSE(s.empty()) << p.name;
        std::int64_t at = 0;
        for (const auto& [first, count] : s) {
          EXPECT_EQ(first, at) << p.name;
          EXPECT_GT(count, 0) << p.name;
          EXPECT_LE(count, most) << p.name;
          at = first + count;
        }
        EXPECT_EQ(at, p.numel()) << p.name;
      }
    // The embedding alone is 29.3 MiB; its pages went as its slices did (1 MiB at most each: the
    // mapping holds a few slices' worth, in folios of up to 2 MiB, wherever the load is).
    std::printf("model file pages mapped while loading: peak %.2f MiB\n", mapped_peak / 1048576.0);
    EXPECT_LT(mapped_peak, 10ull << 20);
    // The store holds the file's values (the masters too, trained).
    for (std::size_t l = 0; l < specs.size(); ++l) {
      const offload::LayerAccess a =
          store.access(l, offload::kAllParts, offload::AccessMode::kRead);
      for (std::size_t i = 0; i < specs[l].params.size(); ++i) {
        const models::ParamSpec& p = specs[l].params[i];
        if (p.tied) continue;
        const at::Tensor want = reader.read(p.name, models::DType::kF32);
        EXPECT_TRUE(at::equal(stream_tensor(a, store, specs, l, i), want)) << p.name;
        if (full) {
          EXPECT_TRUE(at::equal(state_view(a, store, specs, l, i, StateView::kMaster), want))
              << p.name;
        }
        reader.release(p.name);
      }
    }
  }
  fs::remove_all(dir);
}

// The merged export reads the store a chunk (masters) or a weight piece (a frozen part on NVMe)
// at a time, never staging a layer's part whole in the arena: from the NVMe tier, in pieces of
// 1 MiB, it writes the file's own tensors (nothing trained), as from host memory.
TEST(ExportMerged, FromTheNvmeTierInPiecesWritesWhatWasLoaded) {
  const fs::path dir =
      fs::temp_directory_path() / ("rondo-export-merged-test-" + std::to_string(::getpid()));
  test::write_model_folder((dir / "model").string(), 5,
                           {.layers = 2, .hidden = 64, .intermediate = 128, .vocab = 20000});
  const models::WeightReader reader((dir / "model").string());
  const std::vector<models::LayerSpec>& specs = reader.layers();
  const std::uint64_t chunk = 1ull << 20;
  // Norms and the head trained, the rest frozen.
  auto trained = [](const models::ParamSpec& p) {
    return p.name.find("norm") != std::string::npos || p.name == "lm_head.weight";
  };
  for (const bool nvme_tier : {false, true}) {
    SCOPED_TRACE(nvme_tier ? "NVMe" : "host");
    std::vector<offload::LayerDesc> d = layer_descs(specs, trained);
    if (nvme_tier)
      for (offload::LayerDesc& l : d)
        l.base = l.weights = l.optimizer = offload::Tier::kNvme;
    offload::HostArena arena({.pinning = offload::Pinning::kOff});
    std::unique_ptr<offload::NvmeStore> nvme;
    if (nvme_tier)
      nvme = std::make_unique<offload::NvmeStore>(
          offload::NvmeStoreOptions{.dir = (dir / "nvme").string()},
          offload::LayerStore::nvme_bytes(d, kernels::FloatDType::kF32, chunk));
    offload::LayerStore store(arena, d, kernels::FloatDType::kF32, kernels::FloatDType::kF32,
                              nvme.get(), chunk);
    load_weights(store, specs, reader, {}, nullptr);
    store.flush();
    arena.reset_peaks();
    const fs::path out = dir / (nvme_tier ? "merged-nvme" : "merged-host");
    export_merged(out.string(), store, specs, (dir / "model").string(), models::DType::kF32);
    // Staging while exporting: a chunk and a piece read ahead, not the 4.9 MiB embedding.
    EXPECT_LE(arena.usage()[offload::Purpose::kStaging].peak, 3 * store.piece_bytes());
    const models::WeightReader merged(out.string());
    for (const models::LayerSpec& l : specs)
      for (const models::ParamSpec& p : l.params) {
        if (p.tied) continue;
        EXPECT_TRUE(at::equal(merged.read(p.name, models::DType::kF32),
                              reader.read(p.name, models::DType::kF32)))
            << p.name;
      }
  }
  fs::remove_all(dir);
}

}  // namespace
}  // namespace rondo::engine
