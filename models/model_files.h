// The tokenizer and chat template that belong to a model, wherever they are stored: a Hugging Face
// folder's tokenizer.json and tokenizer_config.json, or a GGUF file's tokenizer.ggml.* metadata
// and tokenizer.chat_template. Used by `rondo generate`, the data pipeline and the GUI.
//
//   models::Tokenizer tok = models::load_tokenizer(model_path);
//   models::ChatTemplate t = models::load_model_chat_template(model_path, "");  // or "chatml"
#pragma once

#include <cstdint>
#include <string>

#include "models/chat_template.h"
#include "models/gguf.h"
#include "models/tokenizer.h"

namespace rondo::models {

// From GGUF metadata (see the mapping on TokenizerSpec). Throws Error naming the file and key.
TokenizerSpec tokenizer_spec_from_gguf(const GgufFile& file);
Tokenizer tokenizer_from_gguf(const GgufFile& file);

// The Hugging Face files of a GGUF model's tokenizer, for a merged export: tokenizer.json (the
// spec as `tokenizers` describes it) and tokenizer_config.json (BOS/EOS, whether BOS is added,
// the chat template, `model_max_length`). Byte-level BPE only: a SentencePiece GGUF throws Error
// saying so.
std::string tokenizer_json(const TokenizerSpec& spec, const std::string& source);
std::string tokenizer_config_json(const TokenizerSpec& spec, const GgufFile& file,
                                  std::int64_t model_max_length);

// The tokenizer of a model folder or .gguf file.
Tokenizer load_tokenizer(const std::string& model_path);

// The chat template: `format` by name when not empty (chatml, qwen3, llama3, mistral,
// mistral-v1), else recognised from the model's own template. Errors say how to choose one.
ChatTemplate load_model_chat_template(const std::string& model_path, const std::string& format);

}  // namespace rondo::models
