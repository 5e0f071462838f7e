//! The teachers' own pool of devices (`distillation.nnodes` x `distillation.n_gpus_per_node`,
//! verl's teacher resource pool): each teacher's replicas, one whole model per device, each on a
//! thread of its own that takes micro-batches from its teacher's queue. A rank hands its rows to
//! the pool as soon as the step's batch is rewarded ([`TeacherPool::submit`]) and collects the
//! scores after its own passes over the batch (old log-probs, reference, values), so the teachers
//! score while the trainer's devices work.
//!
//! The micro-batches are the ones the trainer's devices would run (the same rows, padding and
//! shapes), so the scores are the same: bit for bit where the kernels do not depend on the device
//! or the thread count (flex on a CPU).

use std::panic::AssertUnwindSafe;
use std::sync::{mpsc, Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Instant;

use burn::module::Module;
use burn_rlhf_models::CausalLm;
use burn_rlhf_rollout::RolloutBatch;

use super::passes::{PassPlan, Passes, Rows};
use super::teacher::Teacher;
use crate::backend::LearnerBackend;
use crate::distributed::DataParallel;
use crate::error::TrainError;
use crate::forward::LogprobHead;
use crate::minibatch::MicroBatch;

/// What a replica computes of a micro-batch.
#[derive(Debug, Clone, Copy)]
pub(crate) enum TeacherPass {
    /// The sampled tokens' log-probs (and the entropies, dropped).
    Sampled,
    /// The top-k at each position: k planes of log-probs, then k of ids.
    Topk(usize),
}

impl TeacherPass {
    /// The per-token planes the loss reads.
    pub fn planes(self) -> usize {
        match self {
            Self::Sampled => 1,
            Self::Topk(k) => 2 * k,
        }
    }
}

/// How a micro-batch is read: what the rank's own passes would use.
#[derive(Debug, Clone, Copy)]
struct Reading {
    pass: TeacherPass,
    head: LogprobHead,
    shape_bucket: usize,
    remove_padding: Option<bool>,
    fused_kernels: bool,
}

/// One micro-batch for a replica, and where its answer goes.
struct Job {
    tag: usize,
    rows: RolloutBatch,
    reading: Reading,
    reply: mpsc::Sender<(usize, Result<Vec<Rows>, String>)>,
}

/// The teachers on their pool; dropped, the replicas finish their jobs and stop.
pub(crate) struct TeacherPool<B: LearnerBackend> {
    /// Each teacher's queue, in the teachers' order.
    queues: Vec<mpsc::Sender<Job>>,
    /// Each teacher's `key` and name (its model is on the pool).
    routes: Vec<(Option<String>, String)>,
    /// Bytes of one replica of each teacher.
    bytes: Vec<usize>,
    /// Each teacher's replica count.
    replicas: Vec<usize>,
    threads: Vec<JoinHandle<()>>,
    _backend: std::marker::PhantomData<B>,
}

impl<B: LearnerBackend> TeacherPool<B> {
    /// The pool of `teachers` with `replicas[i]` copies of teacher `i`, on `devices` in that order
    /// (one each); each replica computes on its share of this process's compute threads.
    pub fn start(
        teachers: Vec<Teacher<B::InnerBackend>>,
        replicas: &[usize],
        devices: &[B::Device],
    ) -> Self {
        assert_eq!(
            teachers.len(),
            replicas.len(),
            "one replica count per teacher"
        );
        let total: usize = replicas.iter().sum();
        assert_eq!(devices.len(), total, "one device per replica");
        // The trainer keeps a share as large as each replica's.
        let threads_each = (rayon::current_num_threads() / (total + 1)).max(1);
        let mut devices = devices.iter();
        let mut threads = Vec::new();
        let mut queues = Vec::new();
        for (teacher, &count) in teachers.iter().zip(replicas) {
            let (tx, rx) = mpsc::channel::<Job>();
            let rx = Arc::new(Mutex::new(rx));
            for replica in 0..count {
                let device = devices.next().expect("counted above").clone();
                let model = teacher.model.clone().fork(&device.clone().into());
                let (rx, name) = (rx.clone(), format!("teacher-{}-{replica}", teacher.name));
                let compute = rayon::ThreadPoolBuilder::new()
                    .num_threads(threads_each)
                    .thread_name(move |i| format!("teacher-compute-{replica}-{i}"))
                    .build()
                    .expect("a teacher replica's compute threads start");
                let thread = std::thread::Builder::new()
                    .name(name)
                    .spawn(move || serve::<B>(model, device, rx, compute))
                    .expect("a teacher replica's thread starts");
                threads.push(thread);
            }
            queues.push(tx);
        }
        Self {
            queues,
            routes: teachers
                .iter()
                .map(|t| (t.key.clone(), t.name.clone()))
                .collect(),
            bytes: teachers
                .iter()
                .map(|t| crate::offload::param_bytes(&t.model))
                .collect(),
            replicas: replicas.to_vec(),
            threads,
            _backend: std::marker::PhantomData,
        }
    }

    /// Each teacher's `key`, in order.
    pub fn keys(&self) -> impl Iterator<Item = Option<&str>> {
        self.routes.iter().map(|(k, _)| k.as_deref())
    }

    /// Bytes of every replica's weights.
    pub fn bytes(&self) -> usize {
        self.bytes
            .iter()
            .zip(&self.replicas)
            .map(|(b, r)| b * r)
            .sum()
    }

    /// Hands this rank's rows of each teacher's group (`groups`: the batch's rows each teacher
    /// scores) to the pool, cut into the micro-batches `plan` makes on the rank's own devices.
    pub fn submit(
        &self,
        passes: &Passes<'_, B>,
        batch: &RolloutBatch,
        (groups, plan): (Vec<Vec<usize>>, PassPlan),
        (pass, fused_kernels): (TeacherPass, bool),
    ) -> Result<PendingScores, TrainError> {
        let reading = Reading {
            pass,
            head: passes.head,
            shape_bucket: passes.shape_bucket,
            remove_padding: passes.remove_padding,
            fused_kernels,
        };
        let (reply, replies) = mpsc::channel();
        let mut jobs = Vec::new();
        let mut parts = Vec::new();
        for (teacher, rows) in groups.into_iter().enumerate() {
            if rows.is_empty() {
                continue;
            }
            let part = batch.select(&rows);
            let mine = passes.dp.rows_of_rank(&part);
            let own = part.select(&mine);
            let size = plan.micro.unwrap_or(own.rows());
            for (micro, run) in passes.micro_runs(&own, size, plan.max_tokens, plan.key)? {
                let tag = jobs.len();
                jobs.push((parts.len(), micro));
                self.queues[teacher]
                    .send(Job {
                        tag,
                        rows: run,
                        reading,
                        reply: reply.clone(),
                    })
                    .map_err(|_| self.stopped(teacher))?;
            }
            parts.push(TeacherPart {
                teacher,
                rows,
                mine,
            });
        }
        Ok(PendingScores {
            replies,
            jobs,
            parts,
            names: self.routes.iter().map(|(_, n)| n.clone()).collect(),
            rows: batch.rows(),
            width: batch.response_len,
            planes: pass.planes(),
            submitted: Instant::now(),
        })
    }

    fn stopped(&self, teacher: usize) -> TrainError {
        TrainError::config(
            &format!("distillation.teacher_models.{}", self.routes[teacher].1),
            "its replicas on the teachers' pool stopped",
        )
    }
}

impl<B: LearnerBackend> Drop for TeacherPool<B> {
    fn drop(&mut self) {
        self.queues.clear();
        for thread in self.threads.drain(..) {
            // A replica that panicked answered its job with the panic's message already.
            let _ = thread.join();
        }
    }
}

/// A replica: takes its teacher's micro-batches until the pool is dropped.
fn serve<B: LearnerBackend>(
    model: CausalLm<B::InnerBackend>,
    device: B::Device,
    jobs: Arc<Mutex<mpsc::Receiver<Job>>>,
    compute: rayon::ThreadPool,
) {
    let solo = DataParallel::solo();
    loop {
        // One replica waits on the queue at a time; it lets go before computing.
        let job = jobs.lock().unwrap_or_else(|e| e.into_inner()).recv();
        let Ok(job) = job else { return };
        let r = job.reading;
        let passes = Passes::<B> {
            dp: &solo,
            device: &device,
            shape_bucket: r.shape_bucket,
            remove_padding: r.remove_padding,
            head: r.head,
        };
        let out = std::panic::catch_unwind(AssertUnwindSafe(|| {
            compute.install(|| {
                burn_rlhf_algos::kernels::with_kernels(r.fused_kernels, || match r.pass {
                    TeacherPass::Sampled => {
                        let mut out = passes.log_probs_of(&model, &job.rows, false);
                        out.truncate(1);
                        out
                    }
                    TeacherPass::Topk(k) => passes.topk_of(&model, &job.rows, k),
                })
            })
        }))
        .map_err(|panic| crate::error::panic_message(panic.as_ref()));
        // A rank that stopped waiting dropped its receiver: nothing to answer.
        let _ = job.reply.send((job.tag, out));
    }
}

/// One teacher's rows of a batch, as submitted.
struct TeacherPart {
    teacher: usize,
    /// The batch's rows it scores.
    rows: Vec<usize>,
    /// This rank's rows of those (indices into them).
    mine: Vec<usize>,
}

/// A rank's rows at the teachers' pool, until [`PendingScores::wait`].
pub(crate) struct PendingScores {
    replies: mpsc::Receiver<(usize, Result<Vec<Rows>, String>)>,
    /// Each job's teacher part and micro-batch.
    jobs: Vec<(usize, MicroBatch)>,
    parts: Vec<TeacherPart>,
    names: Vec<String>,
    rows: usize,
    width: usize,
    planes: usize,
    submitted: Instant,
}

impl PendingScores {
    /// The scores of every row of the batch (each rank's gathered through `dp`, in the order the
    /// rank's own passes gather them), as `planes` per-token planes `[rows * width]`, and the
    /// seconds from submission to the pool's last answer.
    pub fn wait(self, dp: &DataParallel) -> Result<(Vec<Rows>, f64), TrainError> {
        let width = self.width;
        let mut own: Vec<Vec<Rows>> = self
            .parts
            .iter()
            .map(|p| vec![vec![0.0; p.mine.len() * width]; self.planes])
            .collect();
        let mut answered = 0.0;
        for _ in 0..self.jobs.len() {
            let (tag, out) = self.replies.recv().map_err(|_| {
                TrainError::config(
                    "distillation.teacher_models",
                    "the teachers' pool stopped before answering",
                )
            })?;
            let (part, micro) = &self.jobs[tag];
            let out = out.map_err(|panic| {
                TrainError::config(
                    &format!(
                        "distillation.teacher_models.{}",
                        self.names[self.parts[*part].teacher]
                    ),
                    format!("a replica on the teachers' pool panicked: {panic}"),
                )
            })?;
            for (all, out) in own[*part].iter_mut().zip(out) {
                micro.scatter(&out, all, width);
            }
            answered = self.submitted.elapsed().as_secs_f64();
        }
        let mut all = vec![vec![0.0f32; self.rows * width]; self.planes];
        for (part, own) in self.parts.iter().zip(own) {
            for (plane, own) in all.iter_mut().zip(own) {
                let gathered = dp.gather_rows(&own, &part.mine, part.rows.len(), width)?;
                for (i, &row) in part.rows.iter().enumerate() {
                    plane[row * width..(row + 1) * width]
                        .copy_from_slice(&gathered[i * width..(i + 1) * width]);
                }
            }
        }
        Ok((all, answered))
    }
}

/// The devices `count` after `last` (the trainer's last device): the teachers' pool's.
pub(crate) fn devices_after<D: burn::tensor::backend::DeviceOps>(last: &D, count: usize) -> Vec<D> {
    use burn::tensor::backend::DeviceId;
    let id = last.id();
    (1..=count as u16)
        .map(|i| D::from_id(DeviceId::new(id.type_id, id.index_id + i)))
        .collect()
}
