// What every decode-indexer binary shares on its command line: `--version` and one exit
// status for usage errors (2, with CLI11's message on stderr) instead of CLI11's own codes
// (105, 109, ...). Header-only; needs CLI11.
#pragma once

#include <cstdio>
#include <string>

#include "CLI/CLI.hpp"
#include "common/version_line.h"

namespace decode_indexer::cli {

// Adds --version (prints VersionLine(), exits 0).
inline void AddVersion(CLI::App& app) { app.set_version_flag("--version", VersionLine()); }

// --help and --version: 0; any other parse error: CLI11's message and 2.
inline int ExitCode(const CLI::App& app, const CLI::ParseError& e) {
  const int rc = app.exit(e);
  return rc == 0 ? 0 : 2;
}

}  // namespace decode_indexer::cli

// Drop-in for CLI11_PARSE with the exit codes above.
#define DI_CLI_PARSE(app, argc, argv)                  \
  try {                                                \
    (app).parse((argc), (argv));                       \
  } catch (const CLI::ParseError& e_) {                \
    return ::decode_indexer::cli::ExitCode((app), e_); \
  }
