// rondo: the command line. Subcommands over the engine; errors print as one readable message
// and a non-zero exit code, never a stack trace.
#include <fmt/format.h>
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <cstdio>
#include <exception>
#include <string>

#include "cli/data_command.h"
#include "cli/devices_command.h"
#include "cli/generate_command.h"
#include "cli/inspect_command.h"
#include "cli/train_command.h"
#include "kernels/error.h"
#include "models/tensor_view.h"
#include "offload/process_heap.h"

#ifndef RONDO_VERSION
#define RONDO_VERSION "0.0.0"
#endif

int main(int argc, char** argv) {
  rondo::offload::tune_process_heap();  // before any thread starts
  CLI::App app{
      "Rondo fine-tunes large language models on the GPUs you own, keeping training state in "
      "host memory and streaming it through the GPUs.",
      "rondo"};
  app.require_subcommand(0, 1);
  bool version = false;
  app.add_flag("--version", version, "Print the version and what this build supports");

  rondo::cli::DevicesOptions devices;
  CLI::App* devices_cmd = app.add_subcommand(
      "devices", "List the devices a run would use (CUDA GPUs, or what is used instead)");
  rondo::cli::add_devices_options(*devices_cmd, devices);

  rondo::cli::InspectOptions inspect;
  CLI::App* inspect_cmd = app.add_subcommand(
      "inspect", "Describe a model: family, dimensions, parameters, dtype, bytes per layer");
  rondo::cli::add_inspect_options(*inspect_cmd, inspect);

  rondo::cli::GenerateOptions generate;
  CLI::App* generate_cmd =
      app.add_subcommand("generate", "Generate text from a model (greedy or sampled)");
  rondo::cli::add_generate_options(*generate_cmd, generate);
  rondo::cli::ChatOptions chat;
  CLI::App* chat_cmd =
      app.add_subcommand("chat", "Chat with a run's trained weights or a model, in the terminal");
  rondo::cli::add_chat_options(*chat_cmd, chat);

  rondo::cli::TrainOptions train;
  CLI::App* train_cmd =
      app.add_subcommand("train", "Fine-tune a model (LoRA or full) from a TOML config and flags");
  rondo::cli::add_train_options(*train_cmd, train);

  rondo::cli::TrainOptions plan;
  CLI::App* plan_cmd = app.add_subcommand(
      "plan", "Will a run fit? Device and host memory, disk, predicted speed and time");
  rondo::cli::add_plan_options(*plan_cmd, plan);

  rondo::cli::ExportOptions export_options;
  CLI::App* export_cmd = app.add_subcommand(
      "export", "Write a run's checkpoint as a PEFT adapter or a merged Hugging Face folder");
  rondo::cli::add_export_options(*export_cmd, export_options);

  rondo::cli::DataOptions data;
  CLI::App* data_cmd = app.add_subcommand(
      "data", "What training sees of a JSONL file: format, token statistics, one example masked");
  rondo::cli::add_data_options(*data_cmd, data);

  rondo::cli::DemoOptions demo;
  CLI::App* demo_cmd = app.add_subcommand(
      "demo",
      "Fine-tune the bundled small model on a small dataset, with samples before and after");
  rondo::cli::add_demo_options(*demo_cmd, demo);

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }

  try {
    if (version) {
#ifdef RONDO_WITH_CUDA
      const char* cuda = "CUDA support compiled in";
#else
      const char* cuda = "no CUDA support";
#endif
      fmt::print("rondo {} (libtorch {}, {})\n", RONDO_VERSION, rondo::models::torch_version(),
                 cuda);
      return 0;
    }
    if (devices_cmd->parsed()) return rondo::cli::run_devices(devices);
    if (inspect_cmd->parsed()) return rondo::cli::run_inspect(inspect);
    if (generate_cmd->parsed()) return rondo::cli::run_generate(generate);
    if (chat_cmd->parsed()) return rondo::cli::run_chat(chat);
    if (train_cmd->parsed()) return rondo::cli::run_train(train);
    if (plan_cmd->parsed()) return rondo::cli::run_plan(plan);
    if (export_cmd->parsed()) return rondo::cli::run_export(export_options);
    if (demo_cmd->parsed()) return rondo::cli::run_demo(demo);
    if (data_cmd->parsed()) return rondo::cli::run_data(data);
    std::fputs(app.help().c_str(), stdout);
    return 0;
  } catch (const rondo::Error& e) {
    std::fprintf(stderr, "rondo: error: %s\n", e.what());
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "rondo: internal error: %s\n", e.what());
    return 2;
  }
}
