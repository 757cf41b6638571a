// The real master and worker programs run from a test: a pipeline over
// real workers, the losses and epochs of a --report file.
#pragma once

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "launch/cli.h"
#include "train/events.h"

namespace remora::test_support {

// Losses of every run in a --report file, in order.
std::vector<std::vector<double>> ReportLosses(const std::string& json);
// The list `key` (losses, batch_seconds) of every run in a --report file.
std::vector<std::vector<double>> ReportNumbers(const std::string& json, const std::string& key);

// A pipeline run over `n` real workers; returns the master's exit code and
// output. `common_args` go to the master and every worker; the workers
// must exit with `worker_code` (1 when the master fails: it ends the group).
std::pair<int, std::string> RunPipeline(int n, const std::vector<std::string>& master_args,
                                        const std::vector<std::string>& common_args = {},
                                        int worker_code = 0);

// The losses of `master --local --threads 1` with `args`, one list per
// split count (empty when it failed, which the test is told).
std::vector<std::vector<double>> LocalLosses(const std::vector<std::string>& args, const std::string& name);

// Every batch's loss of `got` within 1e-4 (relative) of `want`'s.
void ExpectSameLosses(const std::vector<double>& got, const std::vector<double>& want, const std::string& what);

// (train_loss, test_accuracy) per epoch in a report.
std::vector<std::pair<double, double>> ReportEpochs(const std::string& json);

// The scalars tagged `tag` of the one TensorBoard event file in `dir`
// (master --tensorboard), and the steps of its restart marks (`restarts`,
// may be null); a test failure when there is not exactly one.
std::vector<train::ScalarEvent> ScalarsIn(const std::string& dir, const std::string& tag,
                                          std::vector<int64_t>* restarts = nullptr);

// TempPath(name), emptied and made.
std::string FreshDir(const std::string& name);

// Stock `worker`s `names` for a master at `addr`, logging to files named
// after `tag`.
std::vector<std::unique_ptr<launch::Subprocess>> StartWorkers(const std::vector<std::string>& names,
                                                              const std::string& addr, const std::string& tag);

// `master` training the small CNN over `workers` on the IDX set in `data`
// (WriteToyIdx): 3 epochs of batches of 32 at --splits 2, one thread; then
// `more`.
std::vector<std::string> MasterArgv(const std::string& workers, const std::string& addr, const std::string& data,
                                    std::vector<std::string> more);

// `key` of each "epoch=E ..." line of `out` (of each line that starts with
// `prefix`); NaN where a line lacks it.
std::vector<double> EpochField(const std::string& out, const std::string& key, const char* prefix = "epoch=");

// About 5 KB of English-like text (a few sentences in a seeded order) in
// TempPath(name); returns the path.
std::string WriteText(const std::string& name);

// The line of `output` that starts with `prefix` ("" when none).
std::string LineStarting(const std::string& output, const std::string& prefix);

// How the stage tensors of the latest checkpoints in `a_path` and
// `b_path` compare: bitwise equal, and the largest difference.
struct StageDifference {
  bool equal = true;
  double largest = 0;
};
StageDifference CompareStages(const std::string& a_path, const std::string& b_path);

}  // namespace remora::test_support
