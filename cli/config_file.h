// config.toml <-> engine::TrainConfig. Reading lists every problem at once — a TOML syntax error
// (file:line:column), an unknown key (with the nearest known one), a value of the wrong type —
// each with the file and line it comes from; overrides ("training.lr=1e-4", from flags) apply on
// top of the file and are named as such. Writing gives the resolved config that a run folder
// keeps, every field spelled out, so a run can be repeated or resumed from it alone.
//
//   cli::ConfigFile f = cli::read_config("train.toml", {"training.steps=100"});
//   f.check();  // every problem at once, each with file:line
#pragma once

#include <map>
#include <string>
#include <vector>

#include "engine/train_config.h"

namespace rondo::cli {

struct ConfigFile {
  engine::TrainConfig config;
  // Where each field set explicitly came from: "train.toml:12" or "--set training.lr=1e-4".
  std::map<std::string, std::string> where;
  // What reading found wrong (unknown keys, wrong types), each with its file:line or flag.
  std::vector<std::string> problems;
  // Prefixes each problem "field: ..." with where that field was set, when known.
  std::vector<std::string> locate(const std::vector<std::string>& problems) const;
  // Throws Error listing every problem at once: reading's and config.validate()'s.
  void check(bool planning = false) const;  // planning: TrainConfig::validate(true)
};

// `path` "" = no file (defaults and overrides only). Throws Error for a file that cannot be read
// or is not TOML (file:line:column); other problems go to ConfigFile::problems (see check()).
ConfigFile read_config(const std::string& path, const std::vector<std::string>& overrides);
ConfigFile read_config_text(const std::string& text, const std::string& source,
                            const std::vector<std::string>& overrides);

std::string to_toml(const engine::TrainConfig& config);

// Every key with its type and default, for `rondo train --help-config`.
std::string config_reference();
// The same as JSON, {"keys": [{"key", "type" (string, bool, integer, number, list), "default",
// "help"}]}: `rondo train --help-config --json`, from which the GUI's Advanced page is built.
std::string config_reference_json();

}  // namespace rondo::cli
