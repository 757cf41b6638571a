// Data read where it is used: the master opens a dataset on the workers
// that host stage 0 (WorkerData::Open, "remora.data.open"), each of which
// opens the same source from its own disk (data::OpenSource), as every
// rank of a DDP job reads its own data. A training step then names only
// its batch's rows and epoch (WorkerRows, Pipeline::start_train_step):
// stage 0's worker reads and augments them itself and sends their labels
// to the last stage's worker ("remora.pipeline.targets"); no image passes
// through the master.
//
//   auto data = WorkerData::Open(agent, {"w1"}, spec, train->size());
//   pipe->start_train_step((*data)->Rows(rows, epoch)).wait();
//
// Thread-safety: WorkerData is used by one thread at a time; the worker's
// table (OpenedSource) is thread-safe.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>

#include "absl/status/statusor.h"
#include "data/source.h"
#include "rpc/agent.h"
#include "rpc/registry.h"

namespace remora::pipeline {

// A batch of a source opened on the workers: its rows (int64 [n]) and the
// epoch that seeds their augmentation.
struct WorkerRows {
  int64_t source = -1;  // WorkerData::id()
  at::Tensor rows;
  int epoch = 0;
};

// A source opened on some workers, closed there when this is destroyed.
// Ownership: the master's; the agent must outlive it.
class WorkerData {
 public:
  // Opens `spec` on each of `workers`; every one must find `rows` rows
  // (what the master's own listing has), else the error names the worker
  // and both counts.
  static absl::StatusOr<std::unique_ptr<WorkerData>> Open(rpc::Agent& agent, std::vector<std::string> workers,
                                                         const data::SourceSpec& spec, int64_t rows);
  ~WorkerData();
  WorkerData(const WorkerData&) = delete;
  WorkerData& operator=(const WorkerData&) = delete;

  int64_t id() const { return id_; }
  int64_t size() const { return rows_; }
  WorkerRows Rows(at::Tensor rows, int epoch) const { return WorkerRows{id_, std::move(rows), epoch}; }
  // The rows the workers have left out so far because their files could
  // not be read (data::SourceSpec::skip_bad_images), summed. A worker the
  // agent holds lost counts with what it said last (the sum never goes
  // back); so does one whose answer failed when `lost` says it is lost
  // now (given the worker and the failure); else the failure is the error.
  absl::StatusOr<int64_t> skipped(
      const std::function<bool(const std::string& worker, const absl::Status& why)>& lost = nullptr) const;

 private:
  WorkerData(rpc::Agent& agent, std::vector<std::string> workers, int64_t id, int64_t rows)
      : agent_(agent), workers_(std::move(workers)), id_(id), rows_(rows) {}

  rpc::Agent& agent_;
  const std::vector<std::string> workers_;
  const int64_t id_;
  const int64_t rows_;
  mutable std::map<std::string, int64_t> last_skipped_;  // each worker's last answer
};

// Worker side: the batch `rows` names, read from this process's source
// (its skipped rows counted for WorkerData::skipped). An error names the
// worker; NotFound for a source this process has not opened.
absl::StatusOr<data::Batch> ReadRows(const std::string& worker, int64_t source, const at::Tensor& rows,
                                     int epoch);

// Registers remora.data.open, skipped and close in a worker's registry.
absl::Status RegisterDataFunctions(rpc::Registry& registry);

// (source, rows, epoch) as one call argument, and back (nullopt for None).
c10::IValue ToIValue(const WorkerRows& rows);
std::optional<WorkerRows> WorkerRowsFrom(const c10::IValue& value);

}  // namespace remora::pipeline
