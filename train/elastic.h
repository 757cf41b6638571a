// Elastic training: a run over workers that loses one goes on by itself
// from its last checkpoint (master --max-restarts, --spares,
// --rejoin-timeout), as torchrun's elastic agent does, but the survivors
// keep their processes.
//
//   train::ElasticOptions o;
//   o.max_restarts = 3;  o.spares = {"spare1"};  o.checkpoint_dir = "/ckpt";
//   train::Elastic elastic(agent, o);
//   std::vector<std::string> workers = {"w1", "w2"};
//   absl::Status s = elastic.Supervise(workers, std::nullopt, out,
//       [&](const std::vector<std::string>& ws, const std::optional<checkpoint::Checkpoint>& from) {
//         ... build the trainer over `ws`, resume `from`, train; call elastic.StepDone(step) after each step
//       });
//
// When an attempt fails, the workers it ran on are probed: one that does not
// answer (killed, hung, cut off) is lost, and its place is taken by a spare
// (a group member that holds no stage; a worker whose place a spare took
// and that registered again since stands by too) or, without one, by a
// process that registers under the lost name within the rejoin timeout
// (restarted by whatever supervises it: remora-launch --max-restarts,
// Slurm, systemd). The next attempt runs over the new list from the latest
// complete checkpoint: every stage and optimizer state is restored there,
// the survivors' too, so that all are at the same step, and the steps after
// it are trained again in the same data order. A failure that lost no
// worker, a loss beyond max_restarts, a run with no checkpoint yet, or a
// worker that does not come back in time fails the run, naming the worker
// and what was waited for.
//
// Thread-safety: an Elastic belongs to the thread that runs the training.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <ostream>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "checkpoint/checkpoint.h"
#include "rpc/agent.h"
#include "train/report.h"

namespace remora::train {

struct ElasticOptions {
  // Failures recovered from in the whole run (each replaces the workers it
  // lost); 0: the first lost worker fails the run, as without elasticity.
  int max_restarts = 0;
  // How long to wait for a lost worker to register again under its name
  // when no spare is free.
  absl::Duration rejoin_timeout = absl::Seconds(60);
  // Group members that hold no stage and stand by, taken in this order.
  std::vector<std::string> spares;
  // Where the run's checkpoints are (the latest complete one is restored).
  std::string checkpoint_dir;
  // The checkpoint the run went on from, when it may not be the latest of
  // checkpoint_dir (one from elsewhere, or written again for another cut
  // beside the one it came from): a recovery goes on from it until the
  // run has saved a later step.
  std::optional<checkpoint::Checkpoint> resumed_from;
  // A worker that does not answer a probe within this is lost.
  absl::Duration probe_timeout = absl::Seconds(5);
  // master --deterministic: each worker that takes a lost one's place (a
  // new process, or a spare) is switched to deterministic algorithms
  // before the next attempt, as the first workers were when they joined.
  bool deterministic = false;
};

class Elastic {
 public:
  // One attempt: train over `workers`, resumed from `from` when set.
  using Attempt = std::function<absl::Status(const std::vector<std::string>& workers,
                                             const std::optional<checkpoint::Checkpoint>& from)>;

  // `log` (may be null) gets run/recoveries at each recovery.
  Elastic(rpc::Agent& agent, ElasticOptions options, std::shared_ptr<RunLog> log = nullptr);

  // Runs `attempt` over `workers` (resumed from `from`), and again after
  // each recovery, until one succeeds or the run cannot recover. Each
  // recovery is a line on `out`. `workers` ends as the last attempt's.
  absl::Status Supervise(std::vector<std::string>& workers, std::optional<checkpoint::Checkpoint> from,
                         std::ostream& out, const Attempt& attempt);

  // The attempt completed step `step` (counted from the run's start).
  void StepDone(int64_t step);

  const std::vector<Recovery>& recoveries() const { return recoveries_; }

 private:
  // After `failure` over `workers`: finds the lost worker, its replacement
  // and the checkpoint to go on from; the error to fail the run with
  // otherwise.
  absl::StatusOr<checkpoint::Checkpoint> Recover(const absl::Status& failure, std::vector<std::string>& workers,
                                                 std::ostream& out);
  // The name that takes `lost`'s place: a free spare, or `lost` itself
  // once it registered again.
  absl::StatusOr<std::string> Replace(const std::string& lost, std::ostream& out);

  rpc::Agent& agent_;
  const ElasticOptions options_;
  std::vector<std::string> free_spares_;
  // Workers whose place a spare took: once one registers again, it stands by.
  std::vector<std::string> replaced_;
  std::shared_ptr<RunLog> log_;
  std::vector<Recovery> recoveries_;
  const absl::Time start_ = absl::Now();
  absl::Time failed_at_time_;
  int64_t last_step_ = 0;
  absl::Time last_step_time_ = start_;  // when last_step_ was done
  int restarts_ = 0;  // failures recovered from (each may replace several workers)
};

}  // namespace remora::train
