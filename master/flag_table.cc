// master's flags: each one's name, help text and the field it sets
// (master/flags.h's AddFlags); what they mean together is checked in
// flags.cc.
#include "launch/cli.h"
#include "master/flags.h"

namespace remora::master {

void AddFlags(launch::FlagParser& flags, Flags* f) {
  RunOptions& c = f->config;
  flags.AddString("workers", &f->workers,
                  "comma-separated worker names (required unless --local): one pipeline over "
                  "them, or with --replicas R, R pipelines of P = n / R workers each, replica r on "
                  "workers r*P .. r*P + P - 1");
  flags.AddString("mode", &f->mode,
                  "pipeline (the model cut into stages over the workers) or ps (a parameter server: "
                  "the master, or --ps-partitions servers, hold the model and optimizer; every step each worker pulls the "
                  "parameters and pushes the gradient of its share of the batch; see "
                  "docs/parameter-server.md)");
  flags.AddInt("ps-partitions", &f->ps.partitions,
               "with --mode ps: K server processes holding a partition of the parameters and its "
               "optimizer each: the first K --workers (0 or 1: the master holds them)");
  flags.AddInt("ps-shards", &f->ps.partitions, "the former name of --ps-partitions");
  flags.AddInt("backup-workers", &f->ps.backup_workers,
               "with --mode ps: k; each step goes on with the first n - k gradient sets and drops "
               "the stragglers' (0: synchronous, equal to one process on the whole batch); the summary counts "
               "each worker's dropped steps");
  flags.AddBool("ps-step-lines", &f->ps.step_lines,
                "with --mode ps: print a line per step (the workers used, dropped and lost, rows, loss, "
                "seconds, bytes); without it only steps that lose a worker print one");
  flags.AddInt("replicas", &c.replicas,
               "data parallelism: copies of the pipeline, each training its share of every "
               "batch, gradients summed per stage over c10d's Gloo (1: none)");
  flags.AddInt("pipeline-stages", &f->pipeline_stages,
               "workers per pipeline, P (0: --workers / --replicas); P x --replicas must be the "
               "worker count");
  flags.AddInt("bucket-mb", &c.bucket_mb, "with --replicas: MiB of gradients summed per bucket");
  flags.AddBool("overlap", &c.overlap,
                "with --replicas: start summing a stage's gradients as its last backward pass "
                "ends, beside the other backward passes (false: after all of them)");
  flags.AddInt("zero", &c.zero,
               "with --replicas: 1 shards the optimizer state over each stage's replicas "
               "(ZeRO-1: each steps its share and sends it to the others); 0: every replica "
               "holds all of it");
  flags.AddInt("collective-timeout", &c.collective_timeout,
               "with --replicas: seconds a replica waits for the others in a collective before "
               "the step fails");
  flags.AddString("listen", &c.listen, "HOST:PORT where workers find the master (MASTER_ADDR/MASTER_PORT also work)");
  flags.AddString("splits", &f->splits,
                  "micro-batches per batch: one count, a sweep (1,2,4,8), or auto (the count, and the "
                  "schedule unless one is named, whose step the planner predicts fastest from the layers' "
                  "times measured on the workers); default 8, or 1 with one stage per replica (--replicas R "
                  "over R workers) and with --mode ps");
  flags.AddInt("batches", &c.batches, "batches per split count");
  flags.AddInt("batch-size", &f->batch_size,
               "images per batch, the whole batch: with --replicas R each replica trains 1/R of it "
               "(PyTorch DDP's batch size is per rank) (default 128; 64 with --dataset)");
  flags.AddInt("image-size", &c.image_size, "image height and width");
  flags.AddDouble("lr", &f->lr,
                  "learning rate (default: SGD 0.05 for the ResNet50 demo, 0.01 with --model or --dataset; Adam "
                  "0.0001 for the demo, 0.001 with --model or --dataset)");
  flags.AddInt("seed", &c.seed, "seed of weights and data: same seed, same numbers");
  flags.AddString("partition", &c.partition,
                  "how ResNet50 or a one-file sequential --model is cut into stages: balanced (by "
                  "each layer's forward + backward time, measured on the workers) or tutorial "
                  "(ResNet50 in two, torchvision's split)");
  flags.AddString("split-at", &f->split_at,
                  "explicit cuts instead of --partition: the first layer of stages 1, 2, ... "
                  "(e.g. 8 or 5,9,14; workers x --interleave stages)");
  flags.AddInt("interleave", &c.interleave,
               "stages per worker: with 2, worker k of n also hosts stage k + n, which halves "
               "the pipeline's fill and drain (0: 2 with --partition balanced when every stage "
               "gets a layer and --schedule is not 1f1b or zb1p, and with zbv; else 1)");
  flags.AddString("schedule", &c.schedule,
                  "gpipe, 1f1b (one stage per worker), interleaved (several stages per worker, --splits a "
                  "multiple of the workers), zb1p (zero bubble, ZB-H1: 1F1B with each backward split into the "
                  "input's gradient and the weights', the latter filling the drain; one stage per worker), zbv "
                  "(zero bubble, ZB-V: two stages per worker in a V, worker k hosting stage k and stage 2n-1-k, "
                  "B and W split as in zb1p; nearly no idle time at 1F1B's activation memory) or "
                  "auto: given, the one of 1f1b, interleaved, zb1p and zbv whose step the planner predicts "
                  "fastest from the layers' times measured on the workers (also with --splits auto); not given, "
                  "1f1b with one stage per worker, else interleaved where --splits is a multiple of the "
                  "workers, else gpipe");
  flags.AddInt("threads", &c.threads,
               "intra-op threads of this process for --local, --compare-local and --mode ps (the "
               "master steps the model); a pipeline's master otherwise slices batches on 1 thread "
               "unless this is given. Not given: --local and --compare-local on a CPU time the first "
               "batch at 1, 2, 4, ... up to the cores and train with the fastest (printed); --threads 1 "
               "gives a pipeline's losses bit for bit; --mode ps: the cores");
  flags.AddBool("local", &c.local, "train in this process alone, no workers");
  flags.AddBool("verbose", &f->verbose,
                "print an error's TorchScript traceback whole (without it: PyTorch's message and the line "
                "that failed)");
  flags.AddBool("deterministic", &c.deterministic,
                "reproducible kernels in this process and on every worker, as PyTorch's "
                "use_deterministic_algorithms (cuDNN's deterministic algorithms, no cuDNN benchmark, cuBLAS's "
                "fixed workspace); operations without a deterministic kernel warn; GPU steps may be slower");
  flags.AddDouble("clip-grad-norm", &c.clip_grad_norm,
                  "clip each step's gradients to this norm over the whole model, as torch.nn.utils.clip_grad_norm_ "
                  "(each worker's share of the squared norm goes to the pipeline's other workers; with --replicas "
                  "after their sum, ZeRO-1 or not; --mode ps: the servers' shares); 0: no clipping");
  flags.AddString("precision", &c.precision,
                  "fp32, or bf16: every stage computes under bf16 autocast (matrix products in bf16; float32 "
                  "parameters, optimizer state and loss) and activations and their gradients cross stage "
                  "boundaries in bf16, half the bytes; --local and --mode ps's workers too");
  flags.AddBool("recompute", &c.recompute,
                "activation recomputation: each stage's training forward pass keeps only its input and runs again "
                "in its backward pass, for the same gradients with less memory held between the two (the summary's "
                "peak saved activations) and a forward pass's time more; over workers (a pipeline, --replicas)");
  flags.AddBool("compare-local", &c.compare_local,
                "also train --local --splits 1 in this process, batch by batch between the last "
                "split count's batches, and print the ratio");
  flags.AddString("report", &c.report, "write a JSON report to this file");
  flags.AddString("trace", &c.trace, "write a Chrome/Perfetto trace of the last split count");
  flags.AddString("timeline", &c.timeline, "write an SVG Gantt chart of the last split count");
  flags.AddString("tensorboard", &c.tensorboard,
                  "write TensorBoard event files into this directory as the run goes (loss, step time and "
                  "images/s per step; loss, test accuracy and images/s per epoch); a --splits sweep writes "
                  "DIR/splits-N per count. View with: tensorboard --logdir DIR");
  flags.AddString("curves", &c.curves, "write the training loss and test accuracy curves as an SVG file");
  flags.AddInt("connect-timeout", &c.connect_timeout, "seconds to wait for all workers to register");
  flags.AddInt("busy-poll-us", &c.busy_poll_us,
               "microseconds the master's threads that wait for the workers' messages and replies keep "
               "looking before they sleep, at most 10000 (as worker --busy-poll-us; REMORA_BUSY_POLL_US "
               "sets it too): a step's replies found sooner for a core spent");
  flags.AddString("device", &c.device,
                  "where --local and --compare-local train: cpu or cuda:N (workers choose their "
                  "own with worker --device)");
  flags.AddString("model", &c.model,
                  "train TorchScript instead of ResNet50: a directory holding stage0.pt, "
                  "stage1.pt, ... or a comma-separated list of .pt files (stage k runs on worker "
                  "k mod n), or one .pt file of a scripted nn.Sequential, cut into stages over the "
                  "workers by --partition or --split-at; random inputs of --input-shape, labels in "
                  "[0, --classes), cross-entropy");
  flags.AddString("input-shape", &f->input_shape,
                  "with --model: one input's shape, e.g. 3,32,32 or 784 (default: the --dataset's images, "
                  "else 3,32,32)");
  flags.AddInt("classes", &c.classes, "with --model: the number of classes of the labels");
  flags.AddString("dataset", &c.dataset,
                  "train on a real dataset for --epochs and print the test accuracy after each: "
                  "fashion-mnist (Debian's dataset-fashion-mnist), idx:DIR (MNIST-format IDX "
                  "files), cifar10:DIR (CIFAR-10's binary version) or imagefolder:DIR (JPEG/PNG files in "
                  "DIR/train/<class>/ and DIR/val/<class>/, or DIR/<class>/ alone, read from disk); the model is "
                  "a small CNN over the workers (1 to 4), ResNet50 for an image folder, or the --model stages; "
                  "cross-entropy. Or text:PATH (a UTF-8 file, or a folder of .txt files): byte-level tokens (or "
                  "--tokenizer's), "
                  "tokenised once into a file beside the checkpoints (or in the temporary directory), trained by "
                  "a GPT (--layers, --d-model, --heads, --seq-len) with the causal language-model loss; the "
                  "held-out tail (--val-fraction, default 0.05) gives the test loss and perplexity");
  flags.AddString("tokenizer", &c.tokenizer,
                  "with --dataset text:PATH: a SentencePiece model file (spm_train makes one) whose tokens the text "
                  "is read as, its vocabulary the GPT's (default: bytes, vocabulary 256; line breaks are no tokens "
                  "under a model); needs Debian's sentencepiece programs");
  flags.AddInt("layers", &c.layers, "with --dataset text:PATH: the GPT's decoder blocks");
  flags.AddInt("d-model", &c.d_model, "with --dataset text:PATH: the GPT's width (a multiple of --heads)");
  flags.AddInt("heads", &c.heads, "with --dataset text:PATH: the GPT's attention heads");
  flags.AddBool("tie-embeddings", &c.tie_embeddings,
                "with --dataset text:PATH: the GPT's head is its token embedding's weight, as nanoGPT's (over "
                "workers the first and the last stage each hold a copy, their gradients summed every step so they "
                "stay equal); false: a head of its own");
  flags.AddInt("seq-len", &c.seq_len,
               "with --dataset text:PATH: tokens a training window (the GPT's context), each window's targets the "
               "tokens one further on");
  flags.AddDouble("peak-tflops", &c.peak_tflops,
                  "with --dataset text:PATH: the device's peak TFLOP/s, to print the model FLOPs utilisation beside "
                  "the TFLOP/s the run reached (0: not printed)");
  flags.AddInt("epochs", &c.epochs, "with --dataset: epochs to train");
  flags.AddInt("eval-every", &c.eval_every,
               "with --dataset: evaluate the test set every N steps too, not only after each epoch (a line "
               "step=S test_accuracy=... test_loss=...[ test_perplexity=...], TensorBoard's step/test_loss, the "
               "report's step_evals; 0: after each epoch only)");
  flags.AddBool("shuffle", &c.shuffle, "with --dataset: shuffle each epoch by --seed (false: file order)");
  flags.AddString("optimizer", &c.optimizer,
                  "sgd, adam or adamw (Adam with decoupled weight decay, --weight-decay) (the ResNet50 demo: plain "
                  "SGD; --dataset text:PATH: adam)");
  flags.AddDouble("weight-decay", &c.weight_decay,
                  "with --optimizer adamw: the decoupled weight decay, on the parameters of two or more dimensions "
                  "(weights and embeddings; biases and norm weights only with --decay-all)");
  flags.AddBool("decay-all", &c.decay_all,
                "with --optimizer adamw: every parameter decays, biases and norm weights too (LibTorch's AdamW "
                "over one group; by default they do not, as in nanoGPT)");
  flags.AddDouble("momentum", &c.momentum, "SGD momentum with --model or --dataset");
  flags.AddString("lr-schedule", &c.lr_schedule,
                  "the learning rate by step after --warmup-steps: constant, cosine (half a cosine down to --min-lr "
                  "at --decay-steps) or linear; every owner of parameters sets its rate by its step count, which "
                  "checkpoints keep");
  flags.AddInt("warmup-steps", &c.warmup_steps,
               "steps whose learning rate climbs linearly to --lr (step n at lr * (n + 1) / N)");
  flags.AddDouble("min-lr", &c.min_lr, "with --lr-schedule cosine or linear: the rate it ends at (default: lr / 10)");
  flags.AddInt("decay-steps", &c.decay_steps,
               "with --lr-schedule cosine or linear: the step at which the rate reaches --min-lr (0: the run's "
               "last)");
  flags.AddInt("train-rows", &c.train_rows,
               "with --dataset: train on N images only (0: all): the first N, or an image folder's N spread "
               "over its classes");
  flags.AddString("data-on", &c.data_on,
                  "with --dataset: where training batches are read: workers (each replica's stage 0 worker, or "
                  "with --mode ps each worker, reads its own rows from its own disk, as DDP's ranks do; the "
                  "master sends row numbers) or master (the master reads them and sends the images)");
  flags.AddInt("data-threads", &c.data_threads,
               "with --dataset imagefolder:DIR: threads that decode and augment the images");
  flags.AddInt("prefetch", &c.prefetch,
               "with --dataset imagefolder:DIR: batches read ahead while a step runs (0: none)");
  flags.AddDouble("val-fraction", &c.val_fraction,
                  "with --dataset imagefolder:DIR that has no val/ folder: hold this fraction of the training "
                  "images out as the test set (chosen by a hash of each file's name: the same files every run; "
                  "0: no test set, no test accuracy); with text:PATH, the text's tail held out (default 0.05)");
  flags.AddBool("skip-bad-images", &c.skip_bad_images,
                "with --dataset imagefolder:DIR: leave unreadable image files out of their batch (counted "
                "on the epoch line) instead of failing the run naming the file");
  flags.AddString("checkpoint-dir", &c.checkpoint_dir,
                  "save checkpoints here (each worker writes its owner file; a shared or same-path directory)");
  flags.AddInt("checkpoint-every", &c.checkpoint_every,
               "with --checkpoint-dir: save every N steps (0: only when training ends)");
  flags.AddInt("keep", &c.keep, "with --checkpoint-dir: how many checkpoints to keep");
  flags.AddBool("checkpoint-background", &c.checkpoint_background,
                "with --checkpoint-dir, pipelines: a checkpoint's step waits only for the workers to copy their "
                "state; they write the files meanwhile and the checkpoint is committed once they are (false: "
                "the step waits for the files; the final checkpoint always does)");
  flags.AddString("resume", &c.resume,
                  "go on from the latest checkpoint in this directory (the same flags as the run that wrote it; "
                  "another worker count, --interleave or --split-at cuts a model the master cuts again); "
                  "auto: from the latest in --checkpoint-dir when there is one, else start fresh (for a "
                  "supervisor that restarts the job)");
  flags.AddInt("max-restarts", &c.max_restarts,
               "with --checkpoint-dir: when a worker dies, is cut off or hangs, do not fail but put a spare "
               "(--spares) or the same worker registering again in its place, restore every stage from the latest "
               "checkpoint and go on; at most N times (0: fail at once)");
  flags.AddInt("rejoin-timeout", &c.rejoin_timeout,
               "with --max-restarts and no spare free: seconds to wait for a lost worker to register again under "
               "its name (restarted by remora-launch --max-restarts, Slurm, systemd)");
  flags.AddString("spares", &f->spares,
                  "with --max-restarts: comma-separated workers that join the group, hold no stage and stand by to "
                  "take a lost worker's place");
  flags.AddSecurityFlags(&f->security);
  flags.AddBool("insecure-collectives", &f->insecure_collectives,
                "with --replicas and a token or TLS: accept that the gradients go over Gloo's connections between "
                "the replicas, which check no token and carry them in clear text "
                "(docs/reliability-and-security.md)");
}

}  // namespace remora::master
