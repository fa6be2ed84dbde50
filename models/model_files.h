// The tokenizer and chat template that belong to a model, wherever they are stored: a Hugging Face
// folder's tokenizer.json and tokenizer_config.json, or a GGUF file's tokenizer.ggml.* metadata
// and tokenizer.chat_template. Used by `rondo generate`, the data pipeline and the GUI.
//
//   models::Tokenizer tok = models::load_tokenizer(model_path);
//   models::ChatTemplate t = models::load_model_chat_template(model_path, "");  // or "chatml"
#pragma once

#include <string>

#include "models/chat_template.h"
#include "models/gguf.h"
#include "models/tokenizer.h"

namespace rondo::models {

// From GGUF metadata (see the mapping on TokenizerSpec). Throws Error naming the file and key.
Tokenizer tokenizer_from_gguf(const GgufFile& file);

// The tokenizer of a model folder or .gguf file.
Tokenizer load_tokenizer(const std::string& model_path);

// The chat template: `format` by name when not empty (chatml, qwen3, llama3, mistral,
// mistral-v1), else recognised from the model's own template. Errors say how to choose one.
ChatTemplate load_model_chat_template(const std::string& model_path, const std::string& format);

}  // namespace rondo::models
