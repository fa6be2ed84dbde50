// engine::training_chat_template (engine/data.h), apart from the JSONL reader: it opens the model's
// files (models/model_files.h, which brings the whole model layer), the reader does not, so the
// JSONL fuzz harness links the reader alone.
#include "engine/data.h"
#include "kernels/error.h"
#include "models/model_files.h"

namespace rondo::engine {

models::ChatTemplate training_chat_template(const std::string& model_path,
                                            const std::string& chat_format, DataFormat format) {
  try {
    return models::load_model_chat_template(model_path, chat_format);
  } catch (const Error& e) {
    if (format != DataFormat::kText)
      throw Error(std::string(e.what()) +
                  " (for plain-text data set data.format = text; for chat or alpaca data set "
                  "data.chat_format)");
    return models::chat_template_from_name("chatml");  // never used for text
  }
}

}  // namespace rondo::engine
