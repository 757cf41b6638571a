// Checkpoints of a pipeline's training: a file per owner, committed
// atomically, resumable, and readable without workers.
//
//   auto saver = checkpoint::Checkpointer::Create(agent, "/ckpt", /*keep=*/3).value();
//   ... every N steps:
//   RETURN_IF_ERROR(saver->Save(*pipe, stages, identity, state));
//
//   // A later run, same flags plus --resume:
//   auto ck = checkpoint::Latest("/ckpt").value();
//   RETURN_IF_ERROR(checkpoint::CheckMatches(ck, identity));
//   auto stages = checkpoint::LoadStageSpecs(ck).value();   // the same cut
//   ... create the pipeline from `stages` ...
//   RETURN_IF_ERROR(checkpoint::Restore(*pipe, ck));
//   // continue from ck.manifest.step
//
// Layout: DIR/step-00000120/ holds one owner file per pipeline worker position
// (owner-<i>.pt: the stages k with k mod P == i, their parameters and
// buffers, the owner's optimizer state and its CPU generator state;
// torch.load reads it), model.pt (the stage specs: registered type and
// arguments, or the TorchScript bytes) and manifest.json (proto/
// checkpoint.proto as JSON: step, position in the data, the run's
// identity, every file's size and CRC-32). Each owner writes its file
// itself, where the master says (a shared file system, or a directory of
// the same path on each host); every file is written to a temporary name,
// fsynced and renamed, and the master writes the manifest last: a
// checkpoint without a manifest is incomplete and never read, so a crash
// mid-save leaves the previous checkpoint as the latest. After a commit,
// all but the newest `keep` checkpoints are removed.
//
// In the background (Save's `background`), the step waits only for each
// owner to copy its state in memory: the owners encode and write their
// files on threads of their own while training goes on, and Poll (after
// any later step), Flush or the next Save commits the manifest once every
// owner file is written. The commit stays atomic: until then the previous
// checkpoint is the latest.
//
// With data parallelism, replica 0's pipeline is saved (every replica
// holds the same parameters and optimizer state) and every replica is
// restored from it. With ZeRO-1 a worker's optimizer state is the whole
// of its gradient group's shares, gathered before the save
// (DataParallelPipeline::ConsolidateOptimizerState) and saved as a
// worker's own optimizer's would be; each replica's group keeps its share
// when it is loaded (Pipeline::optimizer_state_holder).
//
// Thread-safety: a Checkpointer is used by one thread (the training loop);
// the free functions are thread-compatible. Ownership: the Checkpointer
// borrows the agent.
#pragma once

#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "absl/status/statusor.h"
#include "pipeline/pipeline.h"
#include "pipeline/stage.h"
#include "rpc/agent.h"
#include "rpc/registry.h"

namespace remora::checkpoint {

// What the run is; a checkpoint resumes only a run that matches it.
struct RunIdentity {
  std::string model;      // e.g. "resnet50", "torchscript:crc32=..."
  std::string data;       // e.g. "fashion-mnist batch=64 seed=0 shuffle"
  std::string optimizer;  // e.g. "sgd lr=0.01 momentum=0.9"
  std::string schedule;
  int micro_batches = 1;
  int replicas = 1;
  // The run's checkpoint settings: recorded (a resumed run keeps them),
  // not checked.
  int checkpoint_every = 0;
  int keep = 0;
};

// Where the run is: steps taken and the next batch to train.
struct TrainingState {
  int64_t step = 0;
  int epoch = 0;      // from 1 for epochs over a dataset; 0 for batch runs
  int64_t batch = 0;  // the next batch (of the epoch)
  double epoch_loss_sum = 0;
  int64_t epoch_images = 0;
  std::vector<double> losses;  // every step's loss (batch runs)
};

// One stage of a checkpoint's model: what it is built from and which owner file
// holds its tensors.
struct ManifestStage {
  int index = 0;
  std::string kind;  // "type" or "script" (pipeline::StageSpec)
  std::string name;
  int owner = 0;     // index into Manifest::files
};

// One owner's file: its stages' parameters and buffers, its optimizer state
// and its random generator's state.
struct ManifestFile {
  std::string file;    // relative to the checkpoint's directory
  std::string worker;  // the worker that wrote it
  std::vector<int> stages;
  int64_t bytes = 0;
  std::string crc32;   // of the file's bytes, 8 hex digits
};

// A checkpoint's manifest.json, read (its fields are proto/checkpoint.proto's,
// which is how it is written; a C++ struct here so that this header needs
// no protobuf).
struct Manifest {
  int format = 0;
  int64_t step = 0;  // optimizer steps taken
  // The next batch to train (epoch from 1, 0 for batch runs), with the
  // epoch's loss sum and images so far, and every step's loss (batch runs).
  int epoch = 0;
  int64_t batch = 0;
  double epoch_loss_sum = 0;
  int64_t epoch_images = 0;
  std::vector<double> losses;
  // What the run was (RunIdentity), checked on resume.
  std::string model;
  std::string data;
  std::string optimizer;
  std::string schedule;
  int micro_batches = 0;
  int replicas = 0;
  int checkpoint_every = 0;
  int keep = 0;  // 0: not recorded (an older manifest)
  // A tied weight's names (pipeline::PipelineOptions::tied_first and
  // tied_last; empty: none): stored once, as the first stage's tensor
  // tied_first; the last stage's owner file leaves tied_last out, and
  // Restore and LoadModel give it the first stage's.
  std::string tied_first, tied_last;
  std::vector<ManifestStage> stages;
  std::vector<ManifestFile> files;
  std::string model_file;  // the stage specs (model.pt)
  std::string model_crc32;
  std::string master_rng;  // the master's CPU generator state
  bool final = false;      // the run's last checkpoint
  std::string created;     // UTC time
};

// A complete checkpoint: its directory and manifest.
struct Checkpoint {
  std::string dir;
  std::string manifest_path;
  Manifest manifest;
  // Latest over a directory of checkpoints: the newer ones whose manifest
  // could not be read, each "PATH: why" (skipped; the caller says so).
  std::vector<std::string> passed_over;
  TrainingState state() const;
};

class Checkpointer {
 public:
  // Makes `dir` if needed (an error says why it cannot); keeps the newest
  // `keep` (>= 1) checkpoints.
  static absl::StatusOr<std::unique_ptr<Checkpointer>> Create(rpc::Agent& agent, std::string dir, int keep);

  // Saves `pipe` (the stages it was created from: `stages`) at `state` and
  // commits it; `final` marks the run's last checkpoint (an evaluator stops
  // after it). An error names the worker or file that failed; the previous
  // checkpoint stays the latest. With `background` (not with `final`) it
  // returns once every owner has copied its state, and the commit waits
  // for Poll, Flush or the next Save (which finishes an earlier one first).
  absl::Status Save(pipeline::Pipeline& pipe, const std::vector<pipeline::StageSpec>& stages,
                    const RunIdentity& identity, const TrainingState& state, bool final = false,
                    bool background = false);
  // Commits a background save whose owner files are all written: true when it
  // committed one now (last() and last_bytes() are it), false when none is
  // pending or an owner file is still being written. An error names the worker
  // whose write failed; the previous checkpoint stays the latest.
  absl::StatusOr<bool> Poll();
  // Waits for a background save's owner files and commits it (none: OK).
  absl::Status Flush();
  // Whether a background save awaits its commit.
  bool pending() const { return pending_ != nullptr; }

  // Saving step N again (the run's last step was also a periodic one)
  // only commits its manifest again, now `final`.
  // The directory of the last checkpoint saved.
  const std::string& last() const { return last_; }
  int64_t last_bytes() const { return last_bytes_; }
  int64_t last_step() const { return last_manifest_.step; }

 private:
  // A background save: its manifest (without the owner files' sizes and CRCs)
  // and each owner's owner_file_written call.
  struct Pending {
    std::string dir;
    Manifest manifest;
    std::vector<std::string> workers;
    std::vector<rpc::Future<c10::IValue>> written;  // (bytes, crc32) per owner file
  };

  Checkpointer(rpc::Agent& agent, std::string dir, int keep) : agent_(agent), dir_(std::move(dir)), keep_(keep) {}
  // Commits `m` in `dir` (the owner files written, `total` bytes): the manifest,
  // then the bookkeeping and the pruning.
  absl::Status Commit(const Manifest& m, const std::string& dir, int64_t total,
                      const std::vector<std::string>& workers);
  // Removes all but the newest `keep_` complete checkpoints, and incomplete
  // ones older than the newest.
  absl::Status Prune(const std::vector<std::string>& workers);

  rpc::Agent& agent_;
  const std::string dir_;
  const int keep_;
  std::string last_;
  int64_t last_bytes_ = 0;
  Manifest last_manifest_;  // of last_
  std::unique_ptr<Pending> pending_;
};

// The checkpoint in `path` (a trailing '/' or not): a checkpoint's
// directory (with manifest.json) or a directory of checkpoints (the newest
// complete one whose manifest reads; newer ones whose manifest does not are
// listed in passed_over). NotFound when there is none; an error naming the
// file for a manifest that cannot be read (in a directory of checkpoints:
// when none can).
absl::StatusOr<Checkpoint> Latest(const std::string& path);

// Steps of the complete checkpoints in `dir`, ascending.
std::vector<int64_t> CompleteSteps(const std::string& dir);
// Whether `path` is one complete checkpoint's directory (it holds
// manifest.json), not a directory of checkpoints.
bool IsCheckpointDir(const std::string& path);
// The step of a checkpoint directory named step-NNNNNNNN, or -1.
int64_t StepOf(const std::filesystem::path& dir);

// FailedPrecondition naming the manifest and what differs when the run
// `identity` describes is not the checkpoint's (replicas may differ).
absl::Status CheckMatches(const Checkpoint& ck, const RunIdentity& identity);

// The stages the checkpoint was saved from (model.pt, checked).
absl::StatusOr<std::vector<pipeline::StageSpec>> LoadStageSpecs(const Checkpoint& ck);

// Loads the checkpoint into `pipe`: owner file i into the pipeline's worker i
// (its stages' tensors, its optimizer state, its generator), and this
// process's CPU generator. Each worker checks its file's size and CRC-32;
// an error names the file and the worker.
absl::Status Restore(pipeline::Pipeline& pipe, const Checkpoint& ck);

// Sets this process's CPU generator to the state the checkpoint's master
// saved (Restore does; a trainer in this process resuming does too, so
// that its dropout draws go on as they would have). An error names the
// manifest.
absl::Status RestoreCpuGenerator(const Checkpoint& ck);

// Every stage's parameters then buffers, read from the owner files in this
// process (for an evaluator: no workers needed), checked; with `names`,
// their names too (none for a stage saved before owner files named them).
absl::StatusOr<std::vector<std::vector<at::Tensor>>> ReadStageTensors(
    const Checkpoint& ck, std::vector<std::vector<std::string>>* names = nullptr);

// The whole model of a checkpoint, built in this process on `device` from
// its stage specs with its saved parameters and buffers, in eval mode (for
// an evaluator; the stage types must be registered in this process).
absl::StatusOr<std::vector<std::unique_ptr<pipeline::StageModule>>> LoadModel(const Checkpoint& ck,
                                                                              c10::Device device);

// Registers the worker side (remora.checkpoint.save_owner_file, load_owner_file,
// remove) in a worker's registry.
absl::Status RegisterFunctions(rpc::Registry& registry);

// Files: written to a temporary name beside `path`, fsynced, renamed over
// `path`, the directory fsynced; the CRC-32 of bytes as 8 hex digits.
absl::Status WriteFileAtomically(const std::string& path, const std::string& bytes);
absl::StatusOr<std::string> ReadFile(const std::string& path);
std::string Crc32(const std::string& bytes);

}  // namespace remora::checkpoint

// --- Stages held in this process (checkpoint/local.cc) ---------------------
namespace remora::checkpoint {

// What SaveLocal wrote: the checkpoint's directory and its bytes.
struct LocalSave {
  std::string dir;
  int64_t bytes = 0;
};

// Saves stages whose tensors this process holds (a parameter server's
// model, ps/) in the format above, so that Latest, LoadStageSpecs and
// ReadStageTensors read it like any checkpoint: one owner file, owner-0.pt
// (recorded as written by `owner`), holding every stage's `tensors`
// (parameters then buffers) by their `names` (pipeline::StateNames),
// `optimizer` (optim::SaveOptimizerState's bytes or ps::PackPartitionStates',
// or undefined) and this process's CPU generator; model.pt; the manifest,
// written last. Then keeps the newest `keep` (>= 1) checkpoints in `dir`.
// An error names the file that failed; the previous checkpoint stays the
// latest.
absl::StatusOr<LocalSave> SaveLocal(const std::string& dir, const std::vector<pipeline::StageSpec>& stages,
                                    const std::vector<std::vector<at::Tensor>>& tensors,
                                    const std::vector<std::vector<std::string>>& names,
                                    const at::Tensor& optimizer, const RunIdentity& identity,
                                    const TrainingState& state, bool final, int keep,
                                    const std::string& owner = "master");

// The optimizer state of a one-file checkpoint (SaveLocal's), checked;
// undefined when it holds none.
absl::StatusOr<at::Tensor> ReadLocalOptimizer(const Checkpoint& ck);

}  // namespace remora::checkpoint

// --- Another layout (checkpoint/relayout.cc) --------------------------------
namespace remora::checkpoint {

// Writes `ck` again into `dir` (made; what it held is replaced) as a
// checkpoint of `stages`, another cut of the same model with stage k on
// pipeline worker placement[k]: every parameter, buffer and optimizer
// entry is matched by its name in the whole model (TorchScript cuts and
// the built-in models name them so), so a run resumes under another cut,
// stage count or worker count (Restore the pipeline from what it returns).
// The old stages and the new are built on the CPU here to list their
// names; the owner files are read here (one file system with the workers). A
// worker's generators are the old worker's of the same place (the last
// one's beyond the old count): dropout draws go on differently. NotFound
// naming the tensors the new stages have and the checkpoint does not;
// FailedPrecondition naming those it holds that no new stage has, and for
// a checkpoint written before its tensors were named.
absl::StatusOr<Checkpoint> Relayout(const Checkpoint& ck, const std::vector<pipeline::StageSpec>& stages,
                                    const std::vector<int>& placement, const std::string& dir);

}  // namespace remora::checkpoint
