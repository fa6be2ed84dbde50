// Errors in a run's words (run_errors.h).
#include "engine/run_errors.h"

#include <fmt/format.h>

#include "engine/engine.h"
#include "models/config.h"

namespace rondo::engine {

void rethrow_with_settings(std::exception_ptr error) {
  try {
    std::rethrow_exception(error);
  } catch (const DeviceMemoryError& e) {
    if (e.whose == DeviceMemoryError::Whose::kTorch)
      throw Error(std::string(e.what()) +
                  "; use fewer rows per microbatch (training.batch_rows) and more microbatches "
                  "(training.grad_accum), shorter sequences (data.seq_len) or a larger "
                  "hardware.memory_cap");
    throw Error(std::string(e.what()) +
                " (the settings: training.grad_accum for more microbatches, data.seq_len for "
                "shorter sequences, hardware.memory_cap)");
  } catch (const NondeterministicOpError& e) {
    throw Error(std::string(e.what()) +
                " (exact runs use deterministic kernels only; training.deterministic = false runs "
                "this op, and the run is then not bit-exact on GPUs)");
  }
}

std::string positions_error(std::int64_t seq_len, const std::string& path,
                            const models::ModelSummary& model, std::int64_t positions) {
  const std::string head = fmt::format("data.seq_len: {} is more than {} supports ({} positions{})",
                                       seq_len, path, positions,
                                       positions == model.config.max_position_embeddings
                                           ? ", max_position_embeddings in its config"
                                           : ": its YaRN factor times its original context");
  if (model.format == "gguf")
    return head +
           "; lower data.seq_len (a GGUF file's rope scaling is in its metadata: a Hugging "
           "Face folder of the model can be given one in its config.json)";
  const models::RopeAdvice a = models::rope_scaling_advice(model.config, seq_len);
  return head + fmt::format(
                    ". Lower data.seq_len, or let rope scaling stretch the positions: {} is what "
                    "{} is extended with; set in {}/config.json\n  {}\nand the run, its exports "
                    "and chat use it (transformers and vLLM read it too, and llama.cpp's "
                    "converter). Fine-tuning "
                    "at the new length is what teaches the model to use it",
                    a.name, models::to_string(model.config.family), path, a.json);
}

}  // namespace rondo::engine
