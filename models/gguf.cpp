#include "models/gguf.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>
#include <limits>

#include "kernels/error.h"
#include "models/tensor_view.h"

namespace rondo::models {

std::uint64_t gguf_value_size(GgufValueType t) {
  switch (t) {
    case GgufValueType::kU8:
    case GgufValueType::kI8:
    case GgufValueType::kBool:
      return 1;
    case GgufValueType::kU16:
    case GgufValueType::kI16:
      return 2;
    case GgufValueType::kU32:
    case GgufValueType::kI32:
    case GgufValueType::kF32:
      return 4;
    case GgufValueType::kU64:
    case GgufValueType::kI64:
    case GgufValueType::kF64:
      return 8;
    default:
      return 0;
  }
}

const char* to_string(GgufValueType type) {
  switch (type) {
    case GgufValueType::kU8:
      return "UINT8";
    case GgufValueType::kI8:
      return "INT8";
    case GgufValueType::kU16:
      return "UINT16";
    case GgufValueType::kI16:
      return "INT16";
    case GgufValueType::kU32:
      return "UINT32";
    case GgufValueType::kI32:
      return "INT32";
    case GgufValueType::kF32:
      return "FLOAT32";
    case GgufValueType::kBool:
      return "BOOL";
    case GgufValueType::kString:
      return "STRING";
    case GgufValueType::kArray:
      return "ARRAY";
    case GgufValueType::kU64:
      return "UINT64";
    case GgufValueType::kI64:
      return "INT64";
    case GgufValueType::kF64:
      return "FLOAT64";
  }
  return "?";
}

namespace {

constexpr std::uint32_t kMagic = 0x46554747;  // "GGUF" read as a little-endian u32
constexpr std::uint32_t kMaxDims = 4;         // GGML_MAX_DIMS
constexpr int kMaxArrayDepth = 8;             // nesting deeper than this is an attack, not a model
constexpr std::uint64_t kMaxU64 = std::numeric_limits<std::uint64_t>::max();
constexpr std::uint64_t kMaxI64 =
    static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max());

bool known_value_type(std::uint32_t t) {
  return t <= static_cast<std::uint32_t>(GgufValueType::kF64);
}

// The fewest bytes a value of this type can take: bounds every count before anything is reserved.
std::uint64_t min_size(GgufValueType t) {
  if (t == GgufValueType::kString) return 8;  // u64 length
  if (t == GgufValueType::kArray) return 12;  // u32 type + u64 count
  return gguf_value_size(t);
}

bool is_signed_int(GgufValueType t) {
  return t == GgufValueType::kI8 || t == GgufValueType::kI16 || t == GgufValueType::kI32 ||
         t == GgufValueType::kI64;
}

std::int64_t sign_extend(std::uint64_t bits, GgufValueType t) {
  switch (t) {
    case GgufValueType::kI8:
      return static_cast<std::int8_t>(bits);
    case GgufValueType::kI16:
      return static_cast<std::int16_t>(bits);
    case GgufValueType::kI32:
      return static_cast<std::int32_t>(bits);
    default:
      return static_cast<std::int64_t>(bits);
  }
}

std::uint64_t load_le(const std::uint8_t* p, std::uint64_t n) {
  std::uint64_t v = 0;
  std::memcpy(&v, p, n);  // little-endian host (x86-64, aarch64): the low bytes come first
  return v;
}

std::string in_quotes(std::string_view s) {
  return "'" + std::string(s) + "'";
}

}  // namespace

bool GgufValue::is_integer() const {
  switch (type_) {
    case GgufValueType::kU8:
    case GgufValueType::kI8:
    case GgufValueType::kU16:
    case GgufValueType::kI16:
    case GgufValueType::kU32:
    case GgufValueType::kI32:
    case GgufValueType::kU64:
    case GgufValueType::kI64:
      return true;
    default:
      return false;
  }
}

std::optional<std::int64_t> GgufValue::to_int() const {
  if (!is_integer()) return std::nullopt;
  if (is_signed_int(type_)) return sign_extend(bits_, type_);
  if (bits_ > kMaxI64) return std::nullopt;
  return static_cast<std::int64_t>(bits_);
}

std::optional<std::uint64_t> GgufValue::to_uint() const {
  if (!is_integer()) return std::nullopt;
  if (is_signed_int(type_)) {
    std::int64_t v = sign_extend(bits_, type_);
    if (v < 0) return std::nullopt;
    return static_cast<std::uint64_t>(v);
  }
  return bits_;
}

std::optional<double> GgufValue::to_float() const {
  if (type_ == GgufValueType::kF32) {
    float f;
    std::uint32_t b = static_cast<std::uint32_t>(bits_);
    std::memcpy(&f, &b, 4);
    return f;
  }
  if (type_ == GgufValueType::kF64) {
    double d;
    std::memcpy(&d, &bits_, 8);
    return d;
  }
  if (is_signed_int(type_)) return static_cast<double>(sign_extend(bits_, type_));
  if (is_integer()) return static_cast<double>(bits_);
  return std::nullopt;
}

std::optional<bool> GgufValue::to_bool() const {
  if (type_ != GgufValueType::kBool) return std::nullopt;
  return bits_ != 0;
}

std::optional<std::string_view> GgufValue::to_string() const {
  if (type_ != GgufValueType::kString) return std::nullopt;
  return string_;
}

GgufValue GgufValue::at(std::uint64_t i) const {
  RONDO_ASSERT_MSG(type_ == GgufValueType::kArray && i < count_, "GgufValue::at out of range");
  if (element_type_ == GgufValueType::kString) {
    GgufValue v;
    v.type_ = GgufValueType::kString;
    v.string_ = strings_[i];
    return v;
  }
  if (element_type_ == GgufValueType::kArray) return arrays_[i];
  GgufValue v;
  v.type_ = element_type_;
  const std::uint64_t size = gguf_value_size(element_type_);
  v.bits_ = load_le(raw_ + i * size, size);
  return v;
}

std::vector<std::int64_t> GgufTensorInfo::shape() const {
  return std::vector<std::int64_t>(ne.rbegin(), ne.rend());
}

// Reads the header, metadata and tensor infos into a GgufFile, checking each read against the
// file size first. Errors name the file, then `context_` (the key or tensor being read).
class GgufParser {
 public:
  explicit GgufParser(GgufFile& out) : out_(out), file_(out.file_) {}

  void parse() {
    context_ = "header";
    if (file_.size() < 4 || load_le(file_.data(), 4) != kMagic)
      fail("not a GGUF file (it does not start with the bytes 'GGUF')");
    pos_ = 4;
    out_.version_ = u32("version");
    if (out_.version_ == 1)
      fail(
          "GGUF version 1 is not supported (Rondo reads versions 2 and 3); convert the model "
          "again with a current llama.cpp");
    if (out_.version_ != 2 && out_.version_ != 3)
      fail("unsupported GGUF version " + std::to_string(out_.version_) +
           " (Rondo reads versions 2 and 3; big-endian files are not supported)");
    const std::uint64_t n_tensors = u64("tensor count");
    const std::uint64_t n_kv = u64("metadata count");
    // Each metadata entry takes at least 13 bytes (key length, value type, a one-byte value) and
    // each tensor info 24 (name length, n_dims, type, offset): bound both by the file size.
    if (n_kv > remaining() / 13)
      fail("metadata count " + std::to_string(n_kv) + " is more than the " +
           std::to_string(remaining()) + " bytes after the header can hold; the file is corrupt");
    if (n_tensors > remaining() / 24)
      fail("tensor count " + std::to_string(n_tensors) + " is more than the " +
           std::to_string(remaining()) + " bytes after the header can hold; the file is corrupt");

    out_.metadata_.reserve(n_kv);
    for (std::uint64_t i = 0; i < n_kv; ++i) {
      context_ = "metadata entry #" + std::to_string(i) + " (its key)";
      std::string key(str("key length"));
      context_ = "metadata " + in_quotes(key);
      if (out_.metadata_index_.count(key) != 0) fail("the key appears twice");
      const std::uint32_t type = u32("value type");
      if (!known_value_type(type)) fail("unknown value type " + std::to_string(type));
      GgufValue v = value(static_cast<GgufValueType>(type), 0);
      out_.metadata_index_.emplace(key, out_.metadata_.size());
      out_.metadata_.emplace_back(std::move(key), std::move(v));
    }
    read_alignment();

    out_.tensors_.reserve(n_tensors);
    for (std::uint64_t i = 0; i < n_tensors; ++i) {
      context_ = "tensor info #" + std::to_string(i) + " (its name)";
      GgufTensorInfo t;
      t.name = std::string(str("name length"));
      context_ = "tensor " + in_quotes(t.name);
      if (out_.tensor_index_.count(t.name) != 0)
        fail("two tensors have this name; the file is corrupt");
      const std::uint32_t n_dims = u32("dimension count");
      if (n_dims > kMaxDims)
        fail("has " + std::to_string(n_dims) + " dimensions (GGUF allows at most " +
             std::to_string(kMaxDims) + ")");
      for (std::uint32_t d = 0; d < n_dims; ++d) {
        const std::uint64_t ne = u64("dimension");
        if (ne > kMaxI64)
          fail("dimension " + std::to_string(d) + " is too large (" + std::to_string(ne) + ")");
        t.ne.push_back(static_cast<std::int64_t>(ne));
      }
      const std::uint32_t type = u32("type");
      const GgmlTypeInfo* info = ggml_type_info(type);
      if (info == nullptr)
        fail("has unknown ggml type " + std::to_string(type) +
             " (written by a newer llama.cpp, or the file is corrupt)");
      t.type = info->type;
      t.offset = u64("offset");
      size_tensor(t, *info);
      out_.tensor_index_.emplace(t.name, out_.tensors_.size());
      out_.tensors_.push_back(std::move(t));
    }

    // The data section starts at the next multiple of the alignment.
    context_ = "data section";
    const std::uint64_t a = out_.alignment_;
    out_.data_offset_ = (pos_ + (a - 1)) / a * a;  // pos_ <= size < 2^63 and a <= 2^32
    check_tensor_ranges();
  }

 private:
  [[noreturn]] void fail(const std::string& message) const {
    throw Error(file_.path() + ": " + context_ + ": " + message);
  }

  std::uint64_t remaining() const { return file_.size() - pos_; }

  const std::uint8_t* take(std::uint64_t n, const char* field) {
    if (n > remaining())
      fail(std::string(field) + " needs " + std::to_string(n) + " bytes at offset " +
           std::to_string(pos_) + " but the file has " + std::to_string(file_.size()) +
           " bytes; the file is truncated or corrupt");
    const std::uint8_t* p = file_.bytes(pos_, n, context_);
    pos_ += n;
    return p;
  }
  std::uint32_t u32(const char* field) {
    return static_cast<std::uint32_t>(load_le(take(4, field), 4));
  }
  std::uint64_t u64(const char* field) { return load_le(take(8, field), 8); }
  std::string_view str(const char* field) {
    const std::uint64_t n = u64(field);
    if (n > remaining())
      fail("a string of " + std::to_string(n) + " bytes at offset " + std::to_string(pos_) +
           " runs past the end of the file (" + std::to_string(file_.size()) +
           " bytes); the file is truncated or corrupt");
    const std::uint8_t* p = take(n, "string");
    return {reinterpret_cast<const char*>(p), static_cast<std::size_t>(n)};
  }

  GgufValue value(GgufValueType type, int depth) {
    GgufValue v;
    v.type_ = type;
    if (type == GgufValueType::kString) {
      v.string_ = str("string length");
      return v;
    }
    if (type != GgufValueType::kArray) {
      const std::uint64_t n = gguf_value_size(type);
      v.bits_ = load_le(take(n, "value"), n);
      if (type == GgufValueType::kBool && v.bits_ > 1)
        fail("a bool holds " + std::to_string(v.bits_) + " (only 0 and 1 are valid)");
      return v;
    }
    if (depth >= kMaxArrayDepth)
      fail("arrays nested more than " + std::to_string(kMaxArrayDepth) + " deep");
    const std::uint32_t elem = u32("array element type");
    if (!known_value_type(elem)) fail("unknown array element type " + std::to_string(elem));
    v.element_type_ = static_cast<GgufValueType>(elem);
    v.count_ = u64("array length");
    if (v.count_ > remaining() / min_size(v.element_type_))
      fail("an array of " + std::to_string(v.count_) + " " + to_string(v.element_type_) +
           " elements cannot fit in the remaining " + std::to_string(remaining()) +
           " bytes; the file is truncated or corrupt");
    if (v.element_type_ == GgufValueType::kString) {
      v.strings_.reserve(v.count_);
      for (std::uint64_t i = 0; i < v.count_; ++i)
        v.strings_.push_back(str("string length"));
    } else if (v.element_type_ == GgufValueType::kArray) {
      v.arrays_.reserve(v.count_);
      for (std::uint64_t i = 0; i < v.count_; ++i)
        v.arrays_.push_back(value(GgufValueType::kArray, depth + 1));
    } else {
      const std::uint64_t size = gguf_value_size(v.element_type_);
      v.raw_ = take(v.count_ * size, "array");  // count <= remaining / size: no overflow
      if (v.element_type_ == GgufValueType::kBool)
        for (std::uint64_t i = 0; i < v.count_; ++i)
          if (v.raw_[i] > 1)
            fail("bool element " + std::to_string(i) + " holds " + std::to_string(v.raw_[i]) +
                 " (only 0 and 1 are valid)");
    }
    return v;
  }

  void read_alignment() {
    const GgufValue* v = out_.find("general.alignment");
    if (v == nullptr) return;  // GGUF's default, 32
    context_ = "metadata 'general.alignment'";
    const std::optional<std::uint64_t> a = v->to_uint();
    if (!a || *a == 0 || (*a & (*a - 1)) != 0 || *a > (std::uint64_t{1} << 32))
      fail("must be a power of two up to 2^32 (got " +
           (a ? std::to_string(*a) : std::string(to_string(v->type()))) + ")");
    out_.alignment_ = *a;
  }

  // Element count and byte size from the dimensions and the type, overflow-safe.
  void size_tensor(GgufTensorInfo& t, const GgmlTypeInfo& info) {
    std::uint64_t n = 1;
    for (std::int64_t d : t.ne) {
      const auto ud = static_cast<std::uint64_t>(d);
      if (ud != 0 && n > kMaxI64 / ud)
        fail("has more elements than fit in 64 bits (dimensions " + shape_text(t.ne) + ")");
      n *= ud;
    }
    t.n_elements = n;
    const std::int64_t row = t.ne.empty() ? 1 : t.ne[0];
    if (row % info.block_size != 0)
      fail("its rows of " + std::to_string(row) + " elements (dimensions " + shape_text(t.ne) +
           ") are not a multiple of the " + info.name + " block size " +
           std::to_string(info.block_size) + ", so its byte size is undefined");
    const std::uint64_t blocks = n / info.block_size;
    if (blocks > kMaxU64 / info.type_size)
      fail("its byte size does not fit in 64 bits (dimensions " + shape_text(t.ne) + ")");
    t.n_bytes = blocks * info.type_size;
    if (t.offset % out_.alignment_ != 0)
      fail("its offset " + std::to_string(t.offset) + " is not a multiple of the alignment " +
           std::to_string(out_.alignment_));
  }

  void check_tensor_ranges() {
    const std::uint64_t size = file_.size();
    const std::uint64_t data = out_.data_offset_;
    std::vector<const GgufTensorInfo*> by_offset;
    for (const GgufTensorInfo& t : out_.tensors_) {
      context_ = "tensor " + in_quotes(t.name);
      const bool inside =
          data <= size && t.offset <= size - data && t.n_bytes <= size - data - t.offset;
      if (!inside)
        fail("its " + std::to_string(t.n_bytes) + " bytes at data offset " +
             std::to_string(t.offset) + " (file offset " +
             (t.offset <= kMaxU64 - data ? std::to_string(data + t.offset) : "beyond 2^64") +
             ") lie outside the " + std::to_string(size) +
             "-byte file; the file is truncated or corrupt");
      if (t.n_bytes > 0) by_offset.push_back(&t);
    }
    std::sort(
        by_offset.begin(), by_offset.end(),
        [](const GgufTensorInfo* a, const GgufTensorInfo* b) { return a->offset < b->offset; });
    for (std::size_t i = 1; i < by_offset.size(); ++i) {
      const GgufTensorInfo& prev = *by_offset[i - 1];
      const GgufTensorInfo& cur = *by_offset[i];
      if (prev.offset + prev.n_bytes > cur.offset) {  // both inside the file: no overflow
        context_ = "tensor " + in_quotes(cur.name);
        fail("its bytes " + std::to_string(cur.offset) + ".." +
             std::to_string(cur.offset + cur.n_bytes) + " overlap those of tensor " +
             in_quotes(prev.name) + " (" + std::to_string(prev.offset) + ".." +
             std::to_string(prev.offset + prev.n_bytes) + "); the file is corrupt");
      }
    }
  }

  GgufFile& out_;
  const MappedFile& file_;
  std::uint64_t pos_ = 0;
  std::string context_;
};

GgufFile::GgufFile(const std::string& path) : file_(path) {
  GgufParser(*this).parse();
}

const GgufValue* GgufFile::find(std::string_view key) const {
  auto it = metadata_index_.find(std::string(key));
  return it == metadata_index_.end() ? nullptr : &metadata_[it->second].second;
}

const GgufValue& GgufFile::require(std::string_view key) const {
  const GgufValue* v = find(key);
  if (v == nullptr)
    throw Error(path() + ": metadata " + in_quotes(key) +
                " is missing; the file was not written for this model type or is incomplete");
  return *v;
}

void GgufFile::wrong_type(std::string_view key, const GgufValue& v, const char* want) const {
  std::string got = to_string(v.type());
  if (v.type() == GgufValueType::kArray) got += " of " + std::string(to_string(v.element_type()));
  throw Error(path() + ": metadata " + in_quotes(key) + " should be " + want + " but is " + got);
}

std::string GgufFile::get_string(std::string_view key) const {
  const GgufValue& v = require(key);
  auto s = v.to_string();
  if (!s) wrong_type(key, v, "a string");
  return std::string(*s);
}
std::string GgufFile::get_string(std::string_view key, const std::string& fallback) const {
  return has(key) ? get_string(key) : fallback;
}

std::int64_t GgufFile::get_int(std::string_view key) const {
  const GgufValue& v = require(key);
  auto i = v.to_int();
  if (!i) wrong_type(key, v, "an integer that fits in 64 signed bits");
  return *i;
}
std::int64_t GgufFile::get_int(std::string_view key, std::int64_t fallback) const {
  return has(key) ? get_int(key) : fallback;
}

double GgufFile::get_float(std::string_view key) const {
  const GgufValue& v = require(key);
  auto f = v.to_float();
  if (!f) wrong_type(key, v, "a number");
  return *f;
}
double GgufFile::get_float(std::string_view key, double fallback) const {
  return has(key) ? get_float(key) : fallback;
}

bool GgufFile::get_bool(std::string_view key) const {
  const GgufValue& v = require(key);
  auto b = v.to_bool();
  if (!b) wrong_type(key, v, "a bool");
  return *b;
}
bool GgufFile::get_bool(std::string_view key, bool fallback) const {
  return has(key) ? get_bool(key) : fallback;
}

std::vector<std::string> GgufFile::get_strings(std::string_view key) const {
  const GgufValue& v = require(key);
  if (v.type() != GgufValueType::kArray || v.element_type() != GgufValueType::kString)
    wrong_type(key, v, "an array of strings");
  std::vector<std::string> out;
  out.reserve(v.size());
  for (std::uint64_t i = 0; i < v.size(); ++i)
    out.emplace_back(*v.at(i).to_string());
  return out;
}

std::vector<std::int64_t> GgufFile::get_ints(std::string_view key) const {
  const GgufValue& v = require(key);
  if (v.type() != GgufValueType::kArray) wrong_type(key, v, "an array of integers");
  std::vector<std::int64_t> out;
  out.reserve(v.size());
  for (std::uint64_t i = 0; i < v.size(); ++i) {
    auto x = v.at(i).to_int();
    if (!x) wrong_type(key, v, "an array of integers that fit in 64 signed bits");
    out.push_back(*x);
  }
  return out;
}

std::vector<double> GgufFile::get_floats(std::string_view key) const {
  const GgufValue& v = require(key);
  if (v.type() != GgufValueType::kArray) wrong_type(key, v, "an array of numbers");
  std::vector<double> out;
  out.reserve(v.size());
  for (std::uint64_t i = 0; i < v.size(); ++i) {
    auto x = v.at(i).to_float();
    if (!x) wrong_type(key, v, "an array of numbers");
    out.push_back(*x);
  }
  return out;
}

const GgufTensorInfo* GgufFile::find_tensor(std::string_view name) const {
  auto it = tensor_index_.find(std::string(name));
  return it == tensor_index_.end() ? nullptr : &tensors_[it->second];
}

const GgufTensorInfo& GgufFile::tensor(std::string_view name) const {
  const GgufTensorInfo* t = find_tensor(name);
  if (t == nullptr) throw Error(path() + ": has no tensor " + in_quotes(name));
  return *t;
}

const std::uint8_t* GgufFile::tensor_data(const GgufTensorInfo& info) const {
  // The parser checked the range; for a caller's hand-made info, check that data_offset_ +
  // offset cannot wrap around to a place inside the file (data_offset_ itself may lie past the
  // end of a file without tensors), then MappedFile checks the whole range.
  const std::string what = "tensor " + in_quotes(info.name);
  const std::uint64_t size = file_.size();
  if (data_offset_ > size || info.offset > size - data_offset_)
    throw Error(path() + ": " + what + ": data offset " + std::to_string(info.offset) +
                " lies beyond the end of the " + std::to_string(size) + "-byte file");
  return file_.bytes(data_offset_ + info.offset, info.n_bytes, what);
}

at::Tensor load_tensor(const GgufFile& file, std::string_view name, DType target,
                       std::int64_t index) {
  const GgufTensorInfo& t = file.tensor(name);
  const GgmlTypeInfo& type = ggml_type_info(t.type);
  if (!type.dequantizable)
    throw Error(file.path() + ": tensor " + in_quotes(name) + " " + ggml_not_dequantizable(t.type));
  if (target != DType::kF32 && target != DType::kBF16)
    throw Error(file.path() + ": tensor " + in_quotes(name) + ": cannot load into " +
                to_string(target) + " (F32 or BF16 only)");
  std::vector<std::int64_t> shape = t.shape();
  const std::uint8_t* src = file.tensor_data(t);
  auto elements = static_cast<std::int64_t>(t.n_elements);
  if (index >= 0) {
    // The slices of the first torch dimension (the last GGUF one) are contiguous, each a whole
    // number of rows of blocks.
    RONDO_ASSERT(shape.size() >= 2 && index < shape[0]);
    const std::int64_t slices = shape[0];
    shape.erase(shape.begin());
    elements /= slices;
    src += static_cast<std::uint64_t>(index) * (t.n_bytes / static_cast<std::uint64_t>(slices));
  }
  at::Tensor out = at::empty(shape, at::TensorOptions().dtype(to_scalar_type(target)));
  if (type.block_size > 1) {
    // Quantised: one call, which spreads the blocks over oneTBB threads itself.
    const std::int64_t n = elements;
    if (target == DType::kF32)
      dequantize_to_f32(t.type, src, out.data_ptr<float>(), n);
    else
      dequantize_to_bf16(t.type, src,
                         reinterpret_cast<std::uint16_t*>(out.data_ptr<at::BFloat16>()), n);
    return out;
  }
  const std::int64_t blocks = elements / type.block_size;
  const std::int64_t bs = type.block_size, ts = type.type_size;
  // About 64 Ki elements per task: large enough that the threads' start-up cost is negligible.
  const std::int64_t grain = std::max<std::int64_t>(1, 65536 / bs);
  if (target == DType::kF32) {
    float* dst = out.data_ptr<float>();
    at::parallel_for(0, blocks, grain, [&](std::int64_t b0, std::int64_t b1) {
      dequantize_to_f32(t.type, src + b0 * ts, dst + b0 * bs, (b1 - b0) * bs);
    });
  } else {
    auto* dst = reinterpret_cast<std::uint16_t*>(out.data_ptr<at::BFloat16>());
    at::parallel_for(0, blocks, grain, [&](std::int64_t b0, std::int64_t b1) {
      dequantize_to_bf16(t.type, src + b0 * ts, dst + b0 * bs, (b1 - b0) * bs);
    });
  }
  return out;
}

}  // namespace rondo::models
