// tokenizer_config.json, the file beside a tokenizer.json that names the bos/eos tokens and holds
// the chat template. One policy for its two readers (Tokenizer::from_file, load_chat_template): a
// file that is there but cannot be read, is not JSON or is not an object is an Error naming it,
// never silently ignored. Internal to rondo_models.
#pragma once

#include <nlohmann/json.hpp>
#include <string>

namespace rondo::models {

// The parsed file (a JSON object). Throws Error naming `path` otherwise.
nlohmann::json read_tokenizer_config(const std::string& path);

}  // namespace rondo::models
