// Pipeline stages on workers: one wrapper for any module.
//
// A stage is what one worker computes for one part of the model. What it
// computes comes from either
//   - a stage type registered by name in the worker program
//     (RegisterStageType, or RegisterStageModule for a torch::nn::Module
//     whose forward takes and returns a tensor), or
//   - a TorchScript module (torch.jit.script(stage).save(path) in Python),
//     whose bytes the master ships to the worker: the stock worker hosts
//     any TorchScript stage without being rebuilt.
//
// The wrapper (registered module "remora.pipeline.Stage") is written once:
// it fetches its input when it is an RRef to the previous stage's output,
// moves it to the stage's device, runs the forward pass in the worker's
// compute lane in the schedule's order, marks the outputs so that their
// backward pass runs in that order too (runtime/action_mark.h), records
// trace slices, and turns a failure into an error that names the stage,
// the worker and the micro-batch. Contract: stage k's forward takes stage
// k-1's output (a tuple is passed as that many arguments to a TorchScript
// forward); the first stage takes the input batch.
//
// Thread-safety: the stage-type table is process-wide and thread-safe;
// register types before the worker starts serving. A stage's methods run
// one at a time (the registry holds the object's lock).
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <ATen/core/ivalue.h>
// (No torch/nn header: WrapModule and RegisterStageModule are templates on
// the module's type, whose own header brings torch::nn. Left out, a source
// that includes this header compiles in about half the time.)

#include "absl/status/statusor.h"
#include "rpc/agent.h"
#include "rpc/registry.h"

namespace remora::pipeline {

// What a stage computes, whatever defined it.
class StageModule {
 public:
  virtual ~StageModule() = default;
  virtual c10::IValue Forward(const c10::IValue& input) = 0;
  virtual std::vector<at::Tensor> Parameters() = 0;
  virtual std::vector<at::Tensor> Buffers() = 0;
  virtual void Train(bool on) = 0;
  // The names of Parameters() then Buffers(), as PyTorch's state_dict()
  // keys them ("0.weight", "fc.bias"); empty when the module has none
  // (StateNames() then numbers them).
  virtual std::vector<std::string> Names() { return {}; }
};

// `module`'s state: its parameters then buffers, as CPU copies (what the
// stage method "state" and checkpoints hold); and their names: its
// Names(), or "parameters.<i>" then "buffers.<i>" when it gives none.
std::vector<at::Tensor> StateTensors(StageModule& module);
std::vector<std::string> StateNames(StageModule& module);

// Builds a stage type's module from the spec's arguments, on `device`.
// May throw (the caller gets the message).
using StageFactory = std::function<std::unique_ptr<StageModule>(
    const std::vector<c10::IValue>& args, c10::Device device)>;

// Adds a stage type to this process's table; AlreadyExists for a taken name.
absl::Status RegisterStageType(const std::string& name, StageFactory factory);

// A torch::nn::Module whose forward takes and returns one tensor, as a
// StageModule (shares the module).
template <typename M>
std::unique_ptr<StageModule> WrapModule(std::shared_ptr<M> m) {
  class Adapter final : public StageModule {
   public:
    explicit Adapter(std::shared_ptr<M> m) : m_(std::move(m)) {}
    c10::IValue Forward(const c10::IValue& input) override {
      return m_->forward(input.toTensor());
    }
    std::vector<at::Tensor> Parameters() override { return m_->parameters(); }
    std::vector<at::Tensor> Buffers() override { return m_->buffers(); }
    void Train(bool on) override { m_->train(on); }
    std::vector<std::string> Names() override {
      std::vector<std::string> names = m_->named_parameters().keys();
      for (const std::string& b : m_->named_buffers().keys()) names.push_back(b);
      return names;
    }

   private:
    std::shared_ptr<M> m_;
  };
  return std::make_unique<Adapter>(std::move(m));
}

// A torch::nn::Module as a stage type: `make(args, device)` builds it (it
// is moved to `device` afterwards if it is not there).
template <typename M>
absl::Status RegisterStageModule(
    const std::string& name,
    std::function<std::shared_ptr<M>(const std::vector<c10::IValue>& args, c10::Device device)>
        make) {
  return RegisterStageType(
      name, [make](const std::vector<c10::IValue>& args, c10::Device device) {
        std::shared_ptr<M> m = make(args, device);
        m->to(device);
        return WrapModule(std::move(m));
      });
}

// The arguments a TorchScript forward gets for one stage input: a tuple
// spreads into its elements, anything else is the one argument.
std::vector<c10::IValue> ScriptArgs(const c10::IValue& input);

// Loads a TorchScript module from the bytes of a file saved with
// torch.jit.save; InvalidArgument (naming `label`) when they are not one or
// it has no forward method.
absl::StatusOr<std::unique_ptr<StageModule>> LoadScriptStage(const std::string& bytes,
                                                            const std::string& label,
                                                            c10::Device device);

// Copies `state` (parameters then buffers, as the stage method "state"
// returns them) into the module; throws std::invalid_argument naming
// `where` when the count, a name (`names`, when given: StateNames' of the
// saved module), a shape or a dtype differs.
// The parameter of `module` named `name` (its state_dict name); NotFound
// naming `where` and listing the parameters' names.
absl::StatusOr<at::Tensor> ParameterNamed(StageModule& module, const std::string& name, const std::string& where);

// `missing` (with names): a tensor the saved state may lack, kept as it
// is (a tied weight stored with another stage).
void LoadState(StageModule& module, const std::vector<at::Tensor>& state, const std::string& where,
               const std::vector<std::string>& names = {}, const std::string& missing = "");

// A stage hosted on this worker, as the step runner (pipeline/runner.h)
// drives it: it holds the owner RRef, so the stage lives as long as this.
// Thread-safety: Forward takes the stage object's lock, like its methods.
class LocalStage {
 public:
  // The stage behind `rref`, which must be an owner RRef of a
  // "remora.pipeline.Stage" in this process.
  static absl::StatusOr<LocalStage> Resolve(const rpc::RRef& rref);

  // The training forward pass of micro-batch `mb` of batch `context_id` (the
  // batch's autograd context id) on `input`, moved to the stage's device;
  // the caller holds the compute turn of that forward action. The outputs
  // are marked for their backward action (runtime/action_mark.h), split
  // into B and W with `split_backward` (the schedule has W actions).
  // Throws with a message naming the stage, the worker and the micro-batch.
  c10::IValue Forward(const c10::IValue& input, int64_t mb, int64_t context_id, bool split_backward = false) const;
  // The same forward pass in eval mode, without autograd.
  c10::IValue Eval(const c10::IValue& input, int64_t mb) const;

  // The stage's parameter named `name` (its state_dict name); NotFound
  // listing the names there are.
  absl::StatusOr<at::Tensor> Parameter(const std::string& name) const;

  int64_t index() const;
  c10::Device device() const;
  // "stage K", as traces and action marks label it.
  std::string label() const;

 private:
  LocalStage(rpc::RRef rref, rpc::RemoteObject* object) : rref_(std::move(rref)), object_(object) {}
  rpc::RRef rref_;
  rpc::RemoteObject* object_;  // held by rref_
};

// Registers the stage wrapper, the schedule-order function
// ("remora.pipeline.set_order"), the per-layer timing that the
// partitioner asks for ("remora.pipeline.layer_costs", pipeline/partition.h),
// the step runner's functions (pipeline/runner.h) and the master's probes
// ("remora.pipeline.alive", "remora.pipeline.sent_messages") in a worker's
// registry.
absl::Status RegisterFunctions(rpc::Registry& registry);

}  // namespace remora::pipeline
