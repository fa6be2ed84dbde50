#include "engine/checkpoint.h"

#include <ATen/ATen.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cstring>
#include <filesystem>
#include <map>
#include <optional>
#include <set>
#include <string_view>
#include <system_error>
#include <utility>

#include <nlohmann/json.hpp>

#include "engine/checkpoint_format.h"
#include "engine/model_store.h"
#include "kernels/checksum.h"
#include "kernels/cpu/adamw.h"
#include "kernels/cpu/adamw8bit.h"
#include "kernels/error.h"
#include "models/safetensors.h"
#include "offload/layer_store.h"

// Note [Exact resume]
// (What the session, engine/session.cpp, resumes from and recomputes.)
// A resumed run must end bit-identical to one never interrupted. Everything a step computes is a
// function of: the store's trained tensors (masters and moments; the streaming copies are the
// masters rounded, or saved when one-step-stale training lets them lag), the engine's counters
// (steps done, AdamW's step, the fp16 loss scale and its growth counter), the step's batches
// (Batcher::step is a pure function of the data, the options and the step number — the
// shuffling permutation of each epoch is drawn from (seed, epoch)), the learning rate (a pure
// function of the step), and the dropout masks (drawn from (seed, step, microbatch) by a
// counter-based hash, with no generator state) — and the plan: another partition or recompute
// grain computes the same sums in another order (the fused tail runs under autograd, a separate
// backward stage recomputes), so it rounds differently. A checkpoint holds the trained tensors,
// the counters and the plan (the planner's inputs include a speed measured at start, so it is not
// recomputed); the rest is recomputed from the config, which the run folder keeps, and a
// fingerprint of the tokenized data guards against the data file changing in between. On other
// hardware (another number of devices) the run goes on with a new plan and a warning. Checkpoints
// are only written between engine segments, when no step is in flight.
// On a GPU the kernels themselves must repeat: atomics (index_add_ in the experts' scatter) and
// some attention backwards add in whatever order threads arrive. training.deterministic (on by
// default) turns on torch's deterministic algorithms and cuBLAS's fixed workspace for the whole
// process before any GPU work (use_deterministic_torch). Its cost on a GPU is not yet measured;
// CPU kernels are deterministic either way.

namespace rondo::engine {
namespace {

namespace fs = std::filesystem;

using checkpoint_format::kFormat;
using checkpoint_format::kStateFile;
using checkpoint_format::kTensorsFile;
using checkpoint_format::kVersion;
using checkpoint_format::meta_checksum;
using checkpoint_format::read_state_text;
using checkpoint_format::step_of_folder;
constexpr const char* kExpAvg = ".exp_avg";
constexpr const char* kExpAvgSq = ".exp_avg_sq";
constexpr const char* kStream = ".stream";

// A trained tensor's AdamW moments in a checkpoint, by the layer's MomentFormat: f32 m and v as
// torch names them (exp_avg, exp_avg_sq), or their 8-bit codes (uint8, the tensor's shape) and
// absmax (f32, one per block of 256 elements) as ".codes" and ".absmax" of the same names.
struct MomentEntry {
  const char* suffix;
  StateView what;
  models::DType dtype;
  bool per_block;  // shape (blocks): the absmax; else the tensor's shape
};
constexpr MomentEntry kF32Moments[] = {{kExpAvg, StateView::kM, models::DType::kF32, false},
                                       {kExpAvgSq, StateView::kV, models::DType::kF32, false}};
constexpr MomentEntry k8bitMoments[] = {
    {".exp_avg.codes", StateView::kMCodes, models::DType::kU8, false},
    {".exp_avg.absmax", StateView::kMAbsmax, models::DType::kF32, true},
    {".exp_avg_sq.codes", StateView::kVCodes, models::DType::kU8, false},
    {".exp_avg_sq.absmax", StateView::kVAbsmax, models::DType::kF32, true}};
std::vector<MomentEntry> moment_entries(offload::MomentFormat format) {
  return format == offload::MomentFormat::kF32
             ? std::vector<MomentEntry>(std::begin(kF32Moments), std::end(kF32Moments))
             : std::vector<MomentEntry>(std::begin(k8bitMoments), std::end(k8bitMoments));
}
std::vector<std::int64_t> entry_shape(const MomentEntry& e, const models::ParamSpec& spec) {
  return e.per_block ? std::vector<std::int64_t>{static_cast<std::int64_t>(
                           kernels::adamw8bit_blocks(static_cast<std::size_t>(spec.numel())))}
                     : spec.shape;
}
// Whether `name` is a checkpoint entry of a tensor's state other than its master.
bool is_state_entry(std::string_view name) {
  for (const char* suffix : {kExpAvg, kExpAvgSq, kStream})
    if (name.ends_with(suffix)) return true;
  for (const MomentEntry& e : k8bitMoments)
    if (name.ends_with(e.suffix)) return true;
  return false;
}

[[noreturn]] void fail(const std::string& what, const fs::path& path, int err) {
  throw Error(what + " " + path.string() + ": " + std::strerror(err));
}

[[noreturn]] void fail(const std::string& what, const fs::path& path, const std::error_code& ec) {
  throw Error(what + " " + path.string() + ": " + ec.message());
}

// The final name without a trailing slash ("run/ckpt/step-40/" names the folder step-40).
fs::path folder_path(const std::string& dir) {
  if (dir.empty()) throw Error("checkpoint folder: empty path");
  fs::path p = fs::path(dir).lexically_normal();
  if (!p.has_filename()) p = p.parent_path();
  return p;
}

fs::path with_suffix(const fs::path& p, const char* suffix) {
  fs::path out = p;
  out += suffix;
  return out;
}

fs::path parent_of(const fs::path& p) {
  return p.has_parent_path() ? p.parent_path() : fs::path(".");
}

// fsync on a folder makes the entries created, renamed or removed in it durable.
void fsync_dir(const fs::path& dir) {
  int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) fail("cannot open folder", dir, errno);
  int rc = ::fsync(fd);
  int err = errno;
  if (::close(fd) != 0 && rc == 0) fail("cannot close folder", dir, errno);
  if (rc != 0) fail("cannot fsync folder", dir, err);
}

void write_file_synced(const fs::path& path, const std::string& text) {
  int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) fail("cannot create", path, errno);
  std::size_t done = 0;
  while (done < text.size()) {
    ssize_t n = ::write(fd, text.data() + done, text.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      int err = n < 0 ? errno : EIO;
      ::close(fd);
      fail("cannot write", path, err);
    }
    done += static_cast<std::size_t>(n);
  }
  if (::fsync(fd) != 0) {
    int err = errno;
    ::close(fd);
    fail("cannot fsync", path, err);
  }
  if (::close(fd) != 0) fail("cannot close", path, errno);
}

void remove_tree(const fs::path& p) {
  std::error_code ec;
  fs::remove_all(p, ec);
  if (ec) fail("cannot remove", p, ec);
}

bool path_exists(const fs::path& p) {
  std::error_code ec;
  bool yes = fs::exists(fs::symlink_status(p, ec));
  if (ec && ec != std::errc::no_such_file_or_directory) fail("cannot stat", p, ec);
  return yes;
}

void rename_path(const fs::path& from, const fs::path& to) {
  if (::rename(from.c_str(), to.c_str()) != 0)
    throw Error("cannot rename " + from.string() + " to " + to.string() + ": " +
                std::strerror(errno));
}

std::uint64_t file_bytes(const fs::path& p) {
  struct stat st {};
  if (::stat(p.c_str(), &st) != 0) fail("cannot stat", p, errno);
  return static_cast<std::uint64_t>(st.st_size);
}

models::DType model_dtype(kernels::FloatDType dtype) {
  switch (dtype) {
    case kernels::FloatDType::kF32:
      return models::DType::kF32;
    case kernels::FloatDType::kBF16:
      return models::DType::kBF16;
    case kernels::FloatDType::kF16:
      return models::DType::kF16;
  }
  throw InternalError("unknown FloatDType");
}

// An owned trainable tensor of the store: what a checkpoint holds. Tied tensors view their
// owner's master and stream, so the owner's entry covers them.
struct Owned {
  std::size_t layer, index;
  const models::ParamSpec* spec;
  const offload::TensorState* state;
};

std::vector<Owned> owned_trainable(const offload::LayerStore& store,
                                   const std::vector<models::LayerSpec>& specs) {
  RONDO_ASSERT_MSG(specs.size() == store.layers(), "the layer specs do not describe this store");
  std::vector<Owned> out;
  for (std::size_t l = 0; l < store.layers(); ++l) {
    RONDO_ASSERT_MSG(specs[l].params.size() == store.layer(l).size(),
                     "the layer specs do not describe this store");
    for (std::size_t i = 0; i < store.layer(l).size(); ++i) {
      const offload::TensorState& t = store.layer(l)[i];
      if (t.trainable && !t.tied) out.push_back({l, i, &specs[l].params[i], &t});
    }
  }
  return out;
}

}  // namespace

std::uint64_t write_checkpoint(const std::string& dir, offload::LayerStore& store,
                               const std::vector<models::LayerSpec>& specs,
                               const nlohmann::json& meta, bool include_stream,
                               const std::function<void()>& before_rename) {
  const fs::path target = folder_path(dir);
  const fs::path tmp = with_suffix(target, ".tmp");
  const fs::path old = with_suffix(target, ".old");
  const fs::path parent = parent_of(target);

  // The store's state streamed into the file layer by layer (one layer of NVMe-resident state in
  // host memory at a time; host-resident state is written straight from the arena). All f32 state
  // first, the streaming copies (2-byte types possibly of odd length) last, so every f32 tensor
  // starts 4-byte aligned in the file and can be read in place.
  struct Item {
    const Owned* owned;
    StateView what;
  };
  const std::vector<Owned> owned = owned_trainable(store, specs);
  std::vector<models::SafetensorsEntry> entries;
  std::vector<Item> items;
  for (const Owned& o : owned) {
    const std::string& name = o.spec->name;
    entries.push_back({name, models::DType::kF32, o.spec->shape});
    items.push_back({&o, StateView::kMaster});
    for (const MomentEntry& e : moment_entries(store.moments(o.layer))) {
      entries.push_back({name + e.suffix, e.dtype, entry_shape(e, *o.spec)});
      items.push_back({&o, e.what});
    }
  }
  if (include_stream)
    for (const Owned& o : owned) {
      entries.push_back({o.spec->name + kStream, model_dtype(store.stream_dtype()), o.spec->shape});
      items.push_back({&o, StateView::kStream});
    }
  // Masters and moments a chunk at a time (Note [Optimizer chunks] in offload/layer_store.cpp),
  // so that staging holds a chunk, not a layer. The last chunk stays open: a tensor within one
  // chunk has it read once for all its kinds of state, one spanning several has each read once
  // per kind. The streaming copies a layer at a time.
  std::optional<offload::LayerAccess> open;  // the layer whose streaming copies are being written
  std::size_t open_layer = 0;
  std::optional<offload::LayerAccess> chunk;
  std::pair<std::size_t, std::size_t> chunk_at;  // its layer and number
  auto produce = [&](std::size_t k, const models::SafetensorsSink& sink) {
    const Item& it = items[k];
    const std::size_t layer = it.owned->layer;
    if (it.what != StateView::kStream) {
      const auto pieces = store.tensor_pieces(layer, it.owned->index);
      for (std::size_t j = 0; j < pieces.size(); ++j) {
        if (!chunk || chunk_at != std::pair{layer, pieces[j].first}) {
          if (j + 1 < pieces.size()) store.prefetch_chunk(layer, pieces[j + 1].first);
          chunk.reset();
          chunk = store.access_chunk(layer, pieces[j].first, offload::AccessMode::kRead);
          chunk_at = {layer, pieces[j].first};
        }
        const std::size_t p = pieces[j].second;
        const PieceState s = piece_state((*chunk)[p], chunk->piece(p).begin, it.what);
        sink(s.data, s.bytes);
      }
      return;
    }
    if (!open || open_layer != layer) {
      open.reset();
      open = store.access(layer, offload::kStreamPart, offload::AccessMode::kRead);
      open_layer = layer;
    }
    chunk.reset();
    const at::Tensor t = state_view(*open, store, specs, layer, it.owned->index, it.what);
    sink(t.data_ptr(), t.nbytes());
  };

  std::error_code ec;
  fs::create_directories(parent, ec);
  if (ec) fail("cannot create folder", parent, ec);
  if (path_exists(tmp)) remove_tree(tmp);  // a crash mid-write left it: never a checkpoint
  if (::mkdir(tmp.c_str(), 0755) != 0) fail("cannot create folder", tmp, errno);

  std::uint64_t bytes = 0;
  try {
    const fs::path tensors_path = tmp / kTensorsFile;
    // write_safetensors fsyncs the file and its folder (tmp) itself.
    const std::uint64_t tensors_xxh3 =
        models::write_safetensors(tensors_path.string(), entries, {{"format", kFormat}}, produce);
    chunk.reset();
    open.reset();
    const std::uint64_t tensors_bytes = file_bytes(tensors_path);
    bytes += tensors_bytes;

    // Last: its presence marks a complete checkpoint. It vouches for the other file (size and
    // checksum) and for its own "meta" (a checksum of its compact JSON).
    const fs::path state_path = tmp / kStateFile;
    std::string text;
    try {  // meta_checksum dumps meta too: both inside, so bad meta is named below
      const nlohmann::json state = {
          {"format", kFormat},
          {"version", kVersion},
          {"files",
           {{kTensorsFile, {{"bytes", tensors_bytes}, {"xxh3_64", kernels::hex64(tensors_xxh3)}}}}},
          {"meta_xxh3_64", meta_checksum(meta)},
          {"meta", meta}};
      text = state.dump(2) + "\n";
    } catch (const nlohmann::json::exception& e) {  // e.g. a string in meta that is not UTF-8
      throw Error("checkpoint " + target.string() + ": cannot write meta as JSON: " + e.what());
    }
    write_file_synced(state_path, text);
    bytes += file_bytes(state_path);
    fsync_dir(tmp);
  } catch (...) {
    std::error_code ignored;  // already failing: the first error is the one to report
    fs::remove_all(tmp, ignored);
    throw;
  }

  if (before_rename) before_rename();
  // Crash windows: before the first rename the previous checkpoint is intact under `target`;
  // between the two renames it is complete in "<dir>.old" and the new one in "<dir>.tmp"; after
  // the second the new one is in place.
  if (path_exists(target)) {
    if (path_exists(old)) remove_tree(old);
    rename_path(target, old);
  }
  rename_path(tmp, target);
  fsync_dir(parent);
  if (path_exists(old)) {
    remove_tree(old);
    fsync_dir(parent);
  }
  return bytes;
}

nlohmann::json read_checkpoint(const std::string& dir, offload::LayerStore& store,
                               const std::vector<models::LayerSpec>& specs, bool verified) {
  const fs::path folder = folder_path(dir);
  const std::string where = folder.string();
  const fs::path state_path = folder / kStateFile;
  const fs::path tensors_path = folder / kTensorsFile;

  // The folder proves itself before anything of it is used.
  if (const std::vector<std::string> bad =
          verified ? std::vector<std::string>{} : checkpoint_problems(dir);
      !bad.empty()) {
    if (bad.size() == 1) throw Error(where + ": " + bad[0]);
    throw Error(join_problems(where + ": the checkpoint is damaged", bad));
  }
  const nlohmann::json state = nlohmann::json::parse(read_state_text(state_path.string()));
  const models::SafetensorsFile file(tensors_path.string());

  // Validate everything before touching the store.
  const std::vector<Owned> owned = owned_trainable(store, specs);
  const models::DType stream_dtype = model_dtype(store.stream_dtype());
  std::vector<std::pair<std::string, std::string>> problems;  // (kind, message)
  std::set<std::string> expected;
  struct Source {
    const models::TensorEntry *master = nullptr, *stream = nullptr;
    std::vector<const models::TensorEntry*> moments;  // as moment_entries(the layer's format)
  };
  std::vector<Source> sources(owned.size());
  std::size_t with_stream = 0;
  // A problem of one entry: (kind, message), kind empty when the entry is fine.
  using Problem = std::pair<std::string, std::string>;
  auto check = [&](const std::string& name, models::DType dtype,
                   const std::vector<std::int64_t>& shape, bool required,
                   const models::TensorEntry*& out) -> Problem {
    expected.insert(name);
    const models::TensorEntry* e = file.find(name);
    if (e == nullptr)
      return {required ? "missing" : "", "no tensor " + name +
                                             " — was this checkpoint written for another "
                                             "model or LoRA setting?"};
    if (e->shape != shape)
      return {"shape", "tensor " + name + " has shape " + models::shape_text(e->shape) +
                           ", the model needs " + models::shape_text(shape) +
                           " — was this checkpoint written for another model or LoRA rank?"};
    if (e->dtype != dtype)
      return {"dtype", "tensor " + name + " is " + models::to_string(e->dtype) + ", expected " +
                           models::to_string(dtype) +
                           (required ? ""
                                     : " (the streaming dtype of this run; resume with the "
                                       "precision the checkpoint was written with)")};
    std::uint64_t numel = 1;
    for (std::int64_t d : shape)
      numel *= static_cast<std::uint64_t>(d);
    RONDO_ASSERT(e->bytes == numel * dtype_size(dtype));
    out = e;
    return {};
  };
  // Moments kept the other way (f32 in the checkpoint, 8-bit in this run, or the reverse) are one
  // problem for the whole checkpoint, not two per tensor.
  std::size_t other_format = 0;
  for (std::size_t k = 0; k < owned.size(); ++k) {
    const models::ParamSpec& spec = *owned[k].spec;
    Source& s = sources[k];
    const offload::MomentFormat format = store.moments(owned[k].layer);
    const std::vector<MomentEntry> moments = moment_entries(format);
    const Problem master = check(spec.name, models::DType::kF32, spec.shape, true, s.master);
    std::vector<Problem> moment_problems;
    s.moments.assign(moments.size(), nullptr);
    for (std::size_t e = 0; e < moments.size(); ++e)
      moment_problems.push_back(check(spec.name + moments[e].suffix, moments[e].dtype,
                                      entry_shape(moments[e], spec), true, s.moments[e]));
    const Problem stream = check(spec.name + kStream, stream_dtype, spec.shape, false, s.stream);
    if (file.find(spec.name + kStream) != nullptr) ++with_stream;
    // The other format's moments: say so once, and do not also list them as unknown.
    const std::vector<MomentEntry> others =
        moment_entries(format == offload::MomentFormat::kF32 ? offload::MomentFormat::kBlockwise8
                                                             : offload::MomentFormat::kF32);
    bool has_other = false;
    for (const MomentEntry& e : others)
      if (file.find(spec.name + e.suffix) != nullptr) {
        expected.insert(spec.name + e.suffix);
        has_other = true;
      }
    if (has_other && master.first.empty()) {
      ++other_format;
      if (!stream.first.empty()) problems.push_back(stream);
      continue;
    }
    // A tensor missing or misshapen with its moments is one problem, not three.
    bool all_alike = !master.first.empty();
    for (const Problem& p : moment_problems)
      all_alike = all_alike && p.first == master.first;
    if (all_alike) {
      problems.push_back(master);
    } else {
      if (!master.first.empty()) problems.push_back(master);
      for (const Problem& p : moment_problems)
        if (!p.first.empty()) problems.push_back(p);
    }
    if (!stream.first.empty()) problems.push_back(stream);
  }
  if (other_format > 0) {
    const bool run_f32 = store.moments(owned.front().layer) == offload::MomentFormat::kF32;
    problems.emplace_back(
        "optimizer", "this checkpoint keeps the AdamW moments of " + std::to_string(other_format) +
                         " trained tensors in " + (run_f32 ? "8 bits" : "f32") +
                         " and this run keeps them in " + (run_f32 ? "f32" : "8 bits") +
                         " (training.optimizer = \"" + (run_f32 ? "adamw" : "adamw_8bit") +
                         "\"): resume with the optimizer the run was started with");
  }
  for (const models::TensorEntry& e : file.tensors()) {
    if (expected.contains(e.name)) continue;
    // "X.exp_avg" next to an unknown "X" is part of the same problem.
    bool moment_of_unknown = false;
    std::vector<const char*> suffixes = {kExpAvg, kExpAvgSq, kStream};
    for (const MomentEntry& m : k8bitMoments)
      suffixes.push_back(m.suffix);
    for (const char* suffix : suffixes) {
      const std::string_view sv(suffix);
      if (e.name.ends_with(sv)) {
        const std::string base = e.name.substr(0, e.name.size() - sv.size());
        moment_of_unknown |= !expected.contains(base) && file.find(base) != nullptr;
      }
    }
    if (moment_of_unknown) continue;
    problems.emplace_back("unknown", "unknown tensor " + e.name +
                                         " — this run does not train it (another model, LoRA "
                                         "or freezing setting?)");
  }
  if (with_stream != 0 && with_stream != owned.size())
    problems.emplace_back(
        "stream", "streaming copies for " + std::to_string(with_stream) + " of " +
                      std::to_string(owned.size()) +
                      " trained tensors: a checkpoint has them for all or none — it is damaged");
  if (!problems.empty()) {
    // A checkpoint of another setting misses or adds hundreds of tensors: a few of each kind say
    // what happened.
    constexpr std::size_t kShownPerKind = 4;
    std::vector<std::string> shown;
    std::map<std::string, std::size_t> seen, hidden;
    for (const auto& [kind, text] : problems) {
      if (seen[kind]++ < kShownPerKind)
        shown.push_back(text);
      else
        ++hidden[kind];
    }
    const std::map<std::string, std::string> phrase = {
        {"missing", "missing tensors"},        {"unknown", "unknown tensors"},
        {"shape", "tensors of another shape"}, {"dtype", "tensors of another dtype"},
        {"stream", "stream problems"},         {"optimizer", "optimizer problems"}};
    for (const auto& [kind, n] : hidden)
      shown.push_back("... and " + std::to_string(n) + " more " + phrase.at(kind));
    throw Error(join_problems(where + ": cannot resume from this checkpoint", shown));
  }

  // Wherever the store keeps it: the trained streaming copies a layer at a time, the masters and
  // moments a chunk at a time (each chunk opened once, as its first piece comes: owned tensors
  // are in layer and chunk order). Every owned trained tensor is in the file, so both are
  // overwritten whole; streaming copies on NVMe are written a weight piece at a time.
  std::optional<offload::LayerAccess> open, chunk;
  std::optional<offload::PieceWriter> pieces;
  std::size_t chunk_layer = 0, chunk_no = 0;
  for (std::size_t k = 0; k < owned.size(); ++k) {
    const std::size_t layer = owned[k].layer;
    if (k == 0 || owned[k - 1].layer != layer) {
      chunk.reset();
      open.reset();
      if (pieces) pieces->finish();
      pieces.reset();
      if (store.tier(layer, offload::kStreamPart) == offload::Tier::kNvme)
        pieces.emplace(store, layer, offload::kStreamPart);
      else
        open = store.access(layer, offload::kStreamPart, offload::AccessMode::kOverwrite);
    }
    const offload::TensorState& t =
        open ? (*open)[owned[k].index] : store.layer(layer)[owned[k].index];
    const Source& s = sources[k];
    const std::vector<MomentEntry> moments = moment_entries(store.moments(layer));
    // Sharded optimizer state another rank holds: only the streaming copy, from the master.
    const std::vector<std::pair<std::size_t, std::size_t>> pieces_here =
        store.holds_optimizer(layer) ? store.tensor_pieces(layer, owned[k].index)
                                     : std::vector<std::pair<std::size_t, std::size_t>>{};
    for (const auto& [c, p] : pieces_here) {
      if (!chunk || chunk_layer != layer || chunk_no != c) {
        chunk.reset();
        chunk = store.access_chunk(layer, c, offload::AccessMode::kOverwrite);
        chunk_layer = layer;
        chunk_no = c;
      }
      const std::size_t begin = chunk->piece(p).begin;
      auto fill = [&](StateView what, const models::TensorEntry& from) {
        const PieceState into = piece_state((*chunk)[p], begin, what);
        RONDO_ASSERT(into.offset + into.bytes <= from.bytes);
        std::memcpy(into.data, static_cast<const std::uint8_t*>(from.data) + into.offset,
                    into.bytes);
      };
      fill(StateView::kMaster, *s.master);
      for (std::size_t e = 0; e < moments.size(); ++e)
        fill(moments[e].what, *s.moments[e]);
    }
    if (s.stream != nullptr) {
      if (pieces)
        pieces->put(t.stream_offset, s.stream->data, s.stream->bytes);
      else
        std::memcpy(t.stream, s.stream->data, s.stream->bytes);
    } else if (!pieces) {  // the rounding Optimizer::publish_layer and the AdamW kernel apply
      kernels::cast_from_f32(reinterpret_cast<const float*>(s.master->data), t.stream,
                             store.stream_dtype(), t.numel);
    } else {  // the same, a slice at a time
      const std::size_t ss = kernels::dtype_size(store.stream_dtype());
      const std::size_t slice = std::max<std::size_t>(store.piece_bytes() / ss, 1);
      std::vector<std::uint8_t> rounded(std::min(slice, t.numel) * ss);
      for (std::size_t b = 0; b < t.numel; b += slice) {
        const std::size_t n = std::min(slice, t.numel - b);
        kernels::cast_from_f32(reinterpret_cast<const float*>(s.master->data) + b, rounded.data(),
                               store.stream_dtype(), n);
        pieces->put(t.stream_offset + b * ss, rounded.data(), n * ss);
      }
    }
  }
  chunk.reset();
  open.reset();
  if (pieces) pieces->finish();
  store.flush();
  for (std::size_t l = 0; l < store.layers(); ++l) {
    const offload::ByteRange grads = store.grad_bytes(l);
    if (grads.data != nullptr) std::memset(grads.data, 0, grads.bytes);
  }
  return state.at("meta");
}

std::vector<CheckpointInfo> list_checkpoints(const std::string& run_dir) {
  const fs::path folder = fs::path(run_dir) / "checkpoints";
  std::vector<CheckpointInfo> out;
  if (!path_exists(folder)) return out;
  std::error_code list_ec;
  fs::directory_iterator it(folder, list_ec);
  if (list_ec) fail("cannot list", folder, list_ec);
  for (; it != fs::directory_iterator(); it.increment(list_ec)) {
    if (list_ec) fail("cannot list", folder, list_ec);
    const std::string name = it->path().filename().string();
    // Exactly "step-<decimal>", so "step-40.tmp", "step-40.old" and "step-040" are not listed.
    const std::optional<std::int64_t> step = step_of_folder(name);
    if (!step) continue;
    // A folder that vanished or cannot be read meanwhile is not a checkpoint to offer.
    std::error_code ec;
    if (!it->is_directory(ec) || ec) continue;
    if (!fs::is_regular_file(it->path() / kStateFile, ec) || ec) continue;
    out.push_back({*step, it->path().string()});
  }
  if (list_ec) fail("cannot list", folder, list_ec);
  std::sort(out.begin(), out.end(),
            [](const CheckpointInfo& a, const CheckpointInfo& b) { return a.step < b.step; });
  return out;
}

std::map<std::string, at::Tensor> checkpoint_weights(const models::SafetensorsFile& state) {
  std::map<std::string, at::Tensor> out;
  for (const models::TensorEntry& t : state.tensors())
    if (!is_state_entry(t.name)) out.emplace(t.name, t.view());
  return out;
}

CheckpointChoice choose_checkpoint(const std::string& run_dir, const std::string& name) {
  const std::vector<CheckpointInfo> all = list_checkpoints(run_dir);
  auto names = [&] {
    std::string n;
    for (const CheckpointInfo& k : all)
      n += (n.empty() ? "" : ", ") + fs::path(k.path).filename().string();
    return n.empty() ? std::string("the run has none") : "it has: " + n;
  };
  CheckpointChoice out;
  if (!name.empty()) {
    for (const CheckpointInfo& k : all) {
      std::error_code ec;
      if (fs::path(k.path).filename() == name || fs::equivalent(k.path, name, ec)) out.chosen = k;
    }
    if (!out.chosen) throw Error(run_dir + ": no checkpoint " + name + " (" + names() + ")");
    if (const std::vector<std::string> bad = checkpoint_problems(out.chosen->path); !bad.empty())
      throw Error(join_problems(out.chosen->path +
                                    " fails its checks (choose another with "
                                    "--checkpoint; " +
                                    names() + "):",
                                bad));
    return out;
  }
  for (auto k = all.rbegin(); k != all.rend(); ++k) {
    bool damaged = true;
    std::vector<std::string> bad = checkpoint_problems(k->path, &damaged);
    if (bad.empty()) {
      out.chosen = *k;
      break;
    }
    out.skipped.push_back({k->path, std::move(bad), damaged});
  }
  // A step-N folder without state.json is not listed (prune_checkpoints removes that file first,
  // so a crash while pruning leaves such folders, all older than what is kept). One newer than
  // the chosen checkpoint is a checkpoint lost, though: skipped like a damaged one, with a word.
  std::error_code ec;
  const fs::path folder = fs::path(run_dir) / "checkpoints";
  for (fs::directory_iterator it(folder, ec), end; !ec && it != end; it.increment(ec)) {
    const std::optional<std::int64_t> step = step_of_folder(it->path().filename().string());
    std::error_code e2;
    if (!step || (out.chosen && *step <= out.chosen->step) || !it->is_directory(e2) ||
        fs::exists(it->path() / kStateFile, e2))
      continue;
    out.skipped.push_back(
        {it->path().string(),
         {std::string(kStateFile) + " is missing: not a complete checkpoint (a copy or a removal "
                                    "cut short?)"},
         /*damaged=*/true});
  }
  std::sort(out.skipped.begin(), out.skipped.end(),
            [](const SkippedCheckpoint& a, const SkippedCheckpoint& b) {
              return step_of_folder(fs::path(a.path).filename().string()).value_or(0) >
                     step_of_folder(fs::path(b.path).filename().string()).value_or(0);
            });
  return out;
}

void prune_checkpoints(const std::string& run_dir, int keep, std::optional<std::int64_t> written) {
  if (keep <= 0) return;
  std::vector<CheckpointInfo> all = list_checkpoints(run_dir);
  if (written) {  // counted as the newest: kept whatever is listed after it
    auto it = std::find_if(all.begin(), all.end(),
                           [&](const CheckpointInfo& k) { return k.step == *written; });
    if (it != all.end()) std::rotate(it, it + 1, all.end());
  }
  if (all.size() <= static_cast<std::size_t>(keep)) return;
  for (std::size_t k = 0; k + static_cast<std::size_t>(keep) < all.size(); ++k) {
    const fs::path folder(all[k].path);
    const fs::path state = folder / kStateFile;
    // state.json first and durably: from then on the folder is not a checkpoint, whatever part of
    // the rest a crash leaves behind.
    if (::unlink(state.c_str()) != 0) fail("cannot remove", state, errno);
    fsync_dir(folder);
    remove_tree(folder);
  }
  fsync_dir(fs::path(run_dir) / "checkpoints");
}

std::string set_aside_checkpoint(const std::string& dir) {
  const fs::path folder = folder_path(dir);
  fs::path to = with_suffix(folder, ".damaged");
  for (int n = 2; path_exists(to); ++n)
    to = with_suffix(folder, (".damaged." + std::to_string(n)).c_str());
  rename_path(folder, to);
  fsync_dir(parent_of(folder));
  return to.string();
}

nlohmann::json plan_to_json(const Plan& p, std::size_t devices) {
  auto ranges = [](const std::vector<LayerRange>& rs) {
    nlohmann::json a = nlohmann::json::array();
    for (const LayerRange& r : rs)
      a.push_back({r.begin, r.end});
    return a;
  };
  return {{"forward", ranges(p.forward)},         {"tail", {p.tail.begin, p.tail.end}},
          {"backward", ranges(p.backward)},       {"microbatches", p.microbatches},
          {"grain", to_string(p.grain)},          {"devices", devices},
          {"mlp_tile_tokens", p.mlp_tile_tokens}, {"describe", p.describe()}};
}

Plan plan_from_json(const nlohmann::json& j) {
  auto ranges = [](const nlohmann::json& a) {
    std::vector<LayerRange> out;
    for (const auto& r : a)
      out.push_back({r.at(0).get<int>(), r.at(1).get<int>()});
    return out;
  };
  Plan p;
  p.forward = ranges(j.at("forward"));
  p.tail = {j.at("tail").at(0).get<int>(), j.at("tail").at(1).get<int>()};
  p.backward = ranges(j.at("backward"));
  p.microbatches = j.at("microbatches").get<int>();
  p.grain = j.at("grain").get<std::string>() == to_string(RecomputeGrain::kLayer)
                ? RecomputeGrain::kLayer
                : RecomputeGrain::kStage;
  p.mlp_tile_tokens = j.value("mlp_tile_tokens", std::int64_t{0});  // absent before tiling
  return p;
}

}  // namespace rondo::engine
