// Tokenizers: text to token ids and back, exactly as Hugging Face `tokenizers` does it for the
// families Rondo trains: byte-level BPE (GPT-2, Llama 3, Qwen2/2.5/3) and SentencePiece-style BPE
// (Llama 2, Mistral: "▁" for spaces, <0xXX> byte fallback). Invariant: for every construct this
// file accepts, encode() gives the ids `tokenizers` gives (tests/oracle/test_tokenizer.py); every
// other construct is refused with an error naming the file and the JSON path, never approximated.
// Used by the data pipeline, chat templates (models/chat_template.h) and `rondo generate`.
//
//   auto tok = models::Tokenizer::from_file("Qwen2.5-0.5B/tokenizer.json");
//   std::vector<std::int32_t> ids = tok.encode("Hello, world!");
//   std::string text = tok.decode(ids);  // "Hello, world!"
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace rondo::models {

// Pre-tokenizer regexes of the byte-level families (the `Split` patterns of their tokenizer.json),
// for tokenizers described by a TokenizerSpec (GGUF's tokenizer.ggml.pre names one of them).
inline constexpr std::string_view kSplitRegexGpt2 =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";
inline constexpr std::string_view kSplitRegexLlama3 =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
inline constexpr std::string_view kSplitRegexQwen2 =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";

enum class TokenizerKind {
  kByteLevelBpe,      // bytes mapped to printable characters, regex pre-split, no unknown token
  kSentencePieceBpe,  // "▁" for spaces, byte fallback to <0xXX>, unknown token
};

// A tokenizer described by plain fields rather than a tokenizer.json, e.g. from GGUF metadata
// (tokenizer.ggml.*). from_spec() builds the same pipeline `tokenizers` would run for it.
// GGUF mapping: tokenizer.ggml.model "gpt2" -> kByteLevelBpe, "llama" -> kSentencePieceBpe;
// tokens, merges ("a b"), scores; token_type 2 (unknown) and 3 (control) -> special_ids, 4 (user
// defined) -> added_ids; tokenizer.ggml.pre "llama-bpe" -> {kSplitRegexLlama3} + ignore_merges,
// "qwen2" -> {kSplitRegexQwen2} + nfc, "gpt-2"/"default" -> {}, "smollm" -> {R"(\p{N})"} +
// gpt2_split_after; bos/eos/unknown_token_id, add_bos_token, add_eos_token, add_space_prefix.
struct TokenizerSpec {
  TokenizerKind kind = TokenizerKind::kByteLevelBpe;
  std::vector<std::string> tokens;  // id -> token as stored (byte-level: mapped chars; SP: "▁")
  // Merges by rank, first = applied first. SentencePiece: when empty, derived from `scores`
  // (a pair merges when its concatenation is a token; higher score first).
  std::vector<std::pair<std::string, std::string>> merges;
  std::vector<float> scores;              // per id; SentencePiece only
  std::vector<std::int32_t> special_ids;  // control/unknown: split out of text, is_special()
  std::vector<std::int32_t> added_ids;    // user-defined tokens: split out of text, not special
  // Byte-level: Split regexes applied in order (Isolated), then the byte mapping. Empty = GPT-2's
  // built-in ByteLevel split.
  std::vector<std::string> split_regexes;
  bool gpt2_split_after = false;  // byte-level: GPT-2's split after split_regexes too (SmolLM)
  bool nfc = false;               // byte-level: NFC-normalise first (Qwen2)
  bool ignore_merges = false;     // byte-level: a pre-token that is a token stays whole (Llama 3)
  bool byte_fallback = true;      // SentencePiece: unknown chars as <0xXX> tokens
  bool add_space_prefix = true;   // SentencePiece: "▁" before the text
  std::int32_t unk_id = -1;       // -1 = none
  std::int32_t bos_id = -1;       // -1 = none
  std::int32_t eos_id = -1;       // -1 = none
  bool add_bos = false;           // encode(..., add_special_tokens = true) prepends BOS
  bool add_eos = false;           // ... and appends EOS
};

class Tokenizer {
 public:
  // A Hugging Face tokenizer.json. Reads bos_token / eos_token from a tokenizer_config.json in
  // the same folder when there is one (an invalid one is an Error naming it). Throws Error naming
  // the file and the JSON path of any construct it does not support, and what is supported, and
  // of any id outside 0 .. (vocab entries + added tokens - 1).
  static Tokenizer from_file(const std::string& path);
  // tokenizer.json text; `source` names it in errors.
  static Tokenizer from_json(const std::string& json_text, const std::string& source);
  static Tokenizer from_spec(const TokenizerSpec& spec, const std::string& source = "tokenizer");

  // Token ids of `text` (UTF-8; throws Error on invalid UTF-8). add_special_tokens adds what the
  // post-processor adds (BOS for Llama/Mistral, nothing for Qwen).
  std::vector<std::int32_t> encode(std::string_view text, bool add_special_tokens = false) const;

  // Ids with the byte range [first, second) of `text` each token came from (tokens added by the
  // post-processor get an empty range at 0). Chat templates use it for loss masks.
  struct Encoding {
    std::vector<std::int32_t> ids;
    std::vector<std::pair<std::size_t, std::size_t>> offsets;
  };
  Encoding encode_with_offsets(std::string_view text, bool add_special_tokens = false) const;

  // Text of `ids` through the tokenizer's decoder; unknown ids are skipped, invalid UTF-8 becomes
  // U+FFFD as in `tokenizers`.
  std::string decode(const std::vector<std::int32_t>& ids, bool skip_special_tokens = false) const;

  std::int64_t vocab_size() const;  // 1 + the largest id (model vocabulary and added tokens)
  std::optional<std::int32_t> token_to_id(std::string_view token) const;
  std::optional<std::string> id_to_token(std::int32_t id) const;
  std::optional<std::int32_t> bos_id() const;
  std::optional<std::int32_t> eos_id() const;
  bool is_special(std::int32_t id) const;  // special added tokens (decode can skip them)
  TokenizerKind kind() const;
  const std::string& source() const;  // the file (or description) it was loaded from

  struct Impl;

 private:
  explicit Tokenizer(std::shared_ptr<const Impl> impl) : impl_(std::move(impl)) {}
  std::shared_ptr<const Impl> impl_;  // immutable and thread-safe after construction
};

}  // namespace rondo::models
