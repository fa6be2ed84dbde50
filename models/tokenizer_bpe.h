// The BPE model of a tokenizer: vocabulary, merges by rank, and a word's tokens as `tokenizers`'
// BPE computes them (byte fallback, unknown tokens, a cache of recent words). Owns its tables and
// its cache (under a mutex: encode runs on many threads); touches nothing else. Built by the
// tokenizer.json reader and Tokenizer::from_spec, used by the pipeline. Internal to rondo_models.
#pragma once

#include <array>
#include <cstdint>
#include <mutex>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace rondo::models {

struct BpeModel {
  std::unordered_map<std::string, std::int32_t> vocab;
  std::unordered_map<std::uint64_t, std::pair<std::int32_t, std::int32_t>> merges;  // rank, id
  std::int32_t unk_id = -1;
  bool fuse_unk = false;
  bool byte_fallback = false;
  bool ignore_merges = false;
  std::string continuing_subword_prefix;
  std::string end_of_word_suffix;
  std::array<std::int32_t, 256> byte_ids{};  // <0xXX> ids, -1 when missing

  static std::uint64_t key(std::int32_t a, std::int32_t b) {
    return (static_cast<std::uint64_t>(static_cast<std::uint32_t>(a)) << 32) |
           static_cast<std::uint32_t>(b);
  }

  // A word's tokens: id and the byte range of the word it covers.
  struct Tok {
    std::int32_t id;
    std::uint32_t begin, end;
  };

  std::vector<Tok> tokenize(const std::string& w) const;

  // Adds the merge of tokens `a` and `b` at `rank`. Throws Error "source: where: ..." when a part
  // or the result is not in the vocabulary.
  void add_merge(const std::string& a, const std::string& b, std::int32_t rank,
                 const std::string& source, const std::string& where);
  // byte_ids from the vocabulary's <0xXX> tokens.
  void fill_byte_ids();

 private:
  struct Symbol {
    std::int32_t id;
    std::int64_t prev, next;
    std::uint32_t begin, end;  // byte range in the word; end == begin marks a merged-away symbol
  };

  std::vector<Tok> merge_word(const std::string& w) const;

  mutable std::mutex cache_mutex_;
  mutable std::unordered_map<std::string, std::vector<Tok>> cache_;
};

}  // namespace rondo::models
