//! The layout of a run's ranks ([`ParallelMesh`]), decided once at launch and asked by loading,
//! checkpoints, the optimisers and the collectives instead of each working it out again.

use crate::error::TrainError;

/// The key that sets the mesh's tensor-parallel size.
pub const TENSOR_KEY: &str = "actor_rollout_ref.actor.megatron.tensor_model_parallel_size";

/// The key that sets generation's tensor-parallel size.
pub const ROLLOUT_TENSOR_KEY: &str = "actor_rollout_ref.rollout.tensor_model_parallel_size";

/// How the ranks of a run are laid out: `processes` processes of `local` devices each, one rank
/// per device, numbered process by process. Each `tensor` consecutive ranks form a
/// tensor-parallel group that holds one replica of the models, split; the `data` =
/// `world / tensor` replicas train on different rows (and under FSDP or ZeRO-1 share out their
/// parameters or optimiser state, which only whole, unsplit replicas do).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
///
/// Generation may split the policy otherwise (`rollout_tensor`, verl's rollout TP beside FSDP
/// training): each `rollout_tensor` consecutive ranks then generate together as one rollout
/// replica, from the trainer's weights resharded.
pub struct ParallelMesh {
    processes: usize,
    local: usize,
    tensor: usize,
    rollout_tensor: usize,
}

/// One rank's coordinates in its [`ParallelMesh`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MeshPlace {
    /// Its replica, `0..mesh.data()`.
    pub data: usize,
    /// Its place in the replica's tensor-parallel group, `0..mesh.tensor()`.
    pub tensor: usize,
}

impl Default for ParallelMesh {
    fn default() -> Self {
        Self::solo()
    }
}

impl ParallelMesh {
    /// One rank.
    pub const fn solo() -> Self {
        Self {
            processes: 1,
            local: 1,
            tensor: 1,
            rollout_tensor: 1,
        }
    }

    /// The mesh of `processes` processes of `local` devices each, split into tensor-parallel
    /// groups of `tensor` ranks (1: none). A group is consecutive devices of one process, or
    /// consecutive processes of one device each (one process per GPU); other layouts are refused
    /// naming [`TENSOR_KEY`] (or `trainer.n_gpus_per_node` for no devices).
    pub fn new(processes: usize, local: usize, tensor: usize) -> Result<Self, TrainError> {
        if local == 0 {
            return Err(TrainError::config(
                "trainer.n_gpus_per_node",
                "no devices to train on",
            ));
        }
        if tensor == 0 {
            return Err(TrainError::config(TENSOR_KEY, "must be at least 1"));
        }
        let mesh = Self {
            processes: processes.max(1),
            local,
            tensor,
            rollout_tensor: tensor,
        };
        mesh.check_groups(tensor, TENSOR_KEY)?;
        Ok(mesh)
    }

    /// This mesh with generation split over groups of `rollout_tensor` ranks (laid out as the
    /// trainer's groups are), refused naming [`ROLLOUT_TENSOR_KEY`] where they cannot be.
    pub fn with_rollout_tensor(self, rollout_tensor: usize) -> Result<Self, TrainError> {
        if rollout_tensor == 0 {
            return Err(TrainError::config(ROLLOUT_TENSOR_KEY, "must be at least 1"));
        }
        self.check_groups(rollout_tensor, ROLLOUT_TENSOR_KEY)?;
        Ok(Self {
            rollout_tensor,
            ..self
        })
    }

    /// Groups of `size` consecutive ranks are consecutive devices of one process, or consecutive
    /// processes of one device each (one process per GPU).
    fn check_groups(&self, size: usize, key: &str) -> Result<(), TrainError> {
        let (local, processes) = (self.local, self.processes);
        let spans_processes = size > local;
        if !spans_processes && local.is_multiple_of(size) {
            return Ok(());
        }
        if spans_processes && processes == 1 {
            return Err(TrainError::config(
                key,
                format!(
                    "a tensor-parallel group of {size} needs that many devices in this process \
                     (it has {local}), or that many MPI processes"
                ),
            ));
        }
        if !spans_processes || local != 1 || !processes.is_multiple_of(size) {
            return Err(TrainError::config(
                key,
                format!(
                    "a tensor-parallel group of {size} is either in one process (give each a \
                     multiple of it; this one has {local} device(s)) or spans that many MPI \
                     processes of one device each ({processes} process(es) of {local} here)"
                ),
            ));
        }
        Ok(())
    }

    /// Ranks in the run.
    pub fn world(&self) -> usize {
        self.processes * self.local
    }

    /// Data-parallel replicas (each a tensor-parallel group).
    pub fn data(&self) -> usize {
        self.world() / self.tensor
    }

    /// Ranks per tensor-parallel group (1: none).
    pub fn tensor(&self) -> usize {
        self.tensor
    }

    /// Processes in the run.
    pub fn processes(&self) -> usize {
        self.processes
    }

    /// Devices (ranks) per process.
    pub fn local(&self) -> usize {
        self.local
    }

    /// Ranks per rollout replica (the policy's split for generation).
    pub fn rollout_tensor(&self) -> usize {
        self.rollout_tensor
    }

    /// Rollout replicas: generation's share of the prompts is one per replica.
    pub fn rollout_replicas(&self) -> usize {
        self.world() / self.rollout_tensor
    }

    /// Whether generation splits the policy otherwise than training does (its weights are
    /// resharded for each generation).
    pub fn reshards_rollout(&self) -> bool {
        self.rollout_tensor != self.tensor
    }

    /// Whether the models are split over tensor-parallel groups.
    pub fn splits_models(&self) -> bool {
        self.tensor > 1
    }

    /// Whether a model's parameters may be sharded over the data-parallel replicas (FSDP): only
    /// whole models are, so not under tensor parallelism; `offload` (parameters in host memory)
    /// shards even one replica's.
    pub fn shards_parameters(&self, offload: bool) -> bool {
        !self.splits_models() && (self.data() > 1 || offload)
    }

    /// Whether the ranks exchange nothing: one replica (its tensor-parallel ranks exchange only
    /// within their group).
    pub fn one_replica(&self) -> bool {
        self.data() == 1
    }

    /// Rank `rank`'s coordinates.
    pub fn place(&self, rank: usize) -> MeshPlace {
        MeshPlace {
            data: rank / self.tensor,
            tensor: rank % self.tensor,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layouts_one_process_cannot_hold_are_refused_naming_the_key() {
        let mesh = ParallelMesh::new(1, 4, 2).unwrap();
        assert_eq!((mesh.world(), mesh.data(), mesh.tensor()), (4, 2, 2));
        assert_eq!(mesh.place(3), MeshPlace { data: 1, tensor: 1 });
        assert!(ParallelMesh::new(1, 2, 2).unwrap().one_replica());
        // One device per process, groups across processes.
        let across = ParallelMesh::new(4, 1, 2).unwrap();
        assert!(across.tensor() > across.local() && across.data() == 2);
        for (processes, local, tensor, says) in [
            (1, 1, 2, "or that many MPI processes"),
            (1, 3, 2, "give each a multiple of it"),
            (3, 1, 2, "processes of one device each"),
            (2, 2, 4, "processes of one device each"),
        ] {
            let message = ParallelMesh::new(processes, local, tensor)
                .unwrap_err()
                .to_string();
            assert!(
                message.contains("tensor_model_parallel_size") && message.contains(says),
                "{processes} x {local}, tp {tensor}: {message}"
            );
        }
        assert!(ParallelMesh::new(1, 0, 1)
            .unwrap_err()
            .to_string()
            .contains("n_gpus_per_node"));
    }

    #[test]
    fn generation_may_split_a_whole_trainer_into_rollout_replicas() {
        let mesh = ParallelMesh::new(1, 4, 1).unwrap();
        assert!(!mesh.reshards_rollout() && mesh.rollout_replicas() == 4);
        let split = mesh.with_rollout_tensor(2).unwrap();
        assert!(split.reshards_rollout() && !split.splits_models());
        assert_eq!((split.rollout_replicas(), split.data()), (2, 4));
        let message = ParallelMesh::new(1, 3, 1)
            .unwrap()
            .with_rollout_tensor(2)
            .unwrap_err()
            .to_string();
        assert!(
            message.contains("rollout.tensor_model_parallel_size"),
            "{message}"
        );
        // One device per MPI process: a rollout replica spans processes.
        let across = ParallelMesh::new(4, 1, 1)
            .unwrap()
            .with_rollout_tensor(2)
            .unwrap();
        assert!(across.rollout_tensor() > across.local());
    }

    #[test]
    fn only_whole_replicas_shard_their_parameters() {
        let solo = ParallelMesh::solo();
        assert!(!solo.shards_parameters(false) && solo.shards_parameters(true));
        assert!(ParallelMesh::new(1, 2, 1).unwrap().shards_parameters(false));
        let split = ParallelMesh::new(1, 4, 2).unwrap();
        assert!(!split.shards_parameters(false) && !split.shards_parameters(true));
    }
}
