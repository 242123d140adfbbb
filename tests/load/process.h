// Child processes for the load tests: spawn a binary with arguments, wait with a bound,
// signal it. Every child is reaped; nothing outlives the test.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <optional>
#include <string>
#include <vector>

namespace decode_indexer::load_test {

class Process {
 public:
  // Starts argv[0] with argv; stdout and stderr go to log_path (appended) when non-empty.
  static std::optional<Process> Spawn(const std::vector<std::string>& argv,
                                      const std::string& log_path = "");
  Process(Process&& other) noexcept;
  Process& operator=(Process&& other) noexcept;
  ~Process();  // SIGKILLs and reaps a child still running

  // The exit code, or -signal when killed; nullopt if it still runs after `timeout`.
  std::optional<int> Wait(std::chrono::milliseconds timeout);
  void Signal(int signal);
  bool running() const { return pid_ > 0; }

 private:
  explicit Process(pid_t pid) : pid_(pid) {}
  pid_t pid_ = -1;
};

// Runs to completion (bounded by timeout; killed past it) and answers the exit code.
std::optional<int> RunProcess(const std::vector<std::string>& argv, const std::string& log_path,
                              std::chrono::milliseconds timeout);

// A TCP port on 127.0.0.1 that was free a moment ago.
int PickFreePort();

std::string ReadText(const std::string& path);

}  // namespace decode_indexer::load_test
