//! The decode step as a graph: a one-row forward's launches are recorded as a list
//! (they are data, [`Launch`]), and the device replays them as one CUDA graph instead of
//! about 18 launches per layer from the host. Between two decode steps only the launches
//! that carry the position change (per layer: the cache store, and attention's split and
//! merge, whose span count grows every 256 keys): [`diff`] finds them, and the device
//! updates those nodes of the instantiated graph in place rather than building a new one.
//! A different structure (another kernel, another block shape, another number of
//! launches) builds a new graph. The host execution replays the same list launch by
//! launch, so the recording and the diff are tested without a driver; the driver's graph
//! calls have not run on a GPU.

use crate::launch::Launch;

/// What changed between a graph's launches and the next step's.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Change {
    /// Nothing: replay as it is.
    None,
    /// These launches' grids or arguments: update their nodes.
    Params(Vec<usize>),
    /// The list's structure: build a new graph.
    Structure,
}

/// Compares the launches a graph was built from with the next step's.
pub fn diff(old: &[Launch], new: &[Launch]) -> Change {
    if old.len() != new.len() || old.iter().zip(new).any(|(a, b)| a.kernel != b.kernel || a.block != b.block)
    {
        return Change::Structure;
    }
    let changed: Vec<usize> = (0..new.len()).filter(|&i| old[i] != new[i]).collect();
    if changed.is_empty() { Change::None } else { Change::Params(changed) }
}

/// Counters of a [`StepGraph`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GraphStats {
    /// Steps replayed.
    pub replays: u64,
    /// Graphs built (the first step, and each change of structure).
    pub builds: u64,
    /// Nodes updated in place.
    pub node_updates: u64,
}

/// A recorded decode step and, on a GPU, its instantiated graph.
#[derive(Default)]
pub struct StepGraph {
    pub(crate) launches: Vec<Launch>,
    #[cfg(feature = "cuda")]
    pub(crate) device: Option<crate::device::CudaGraph>,
    pub(crate) stats: GraphStats,
}

impl StepGraph {
    /// Its counters.
    pub fn stats(&self) -> GraphStats {
        self.stats
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::launch::{Arg, AttnBuffers, AttnShape, Out, kv_store};

    fn step(start: usize) -> Vec<Launch> {
        let shape =
            AttnShape { rows: 1, start, kv_heads: 2, group: 4, head_dim: 64, capacity: 2048, out: Out::F16 };
        let [split, merge] =
            shape.launches(AttnBuffers { q: 16, keys: 32, values: 48, scratch: 64, out: 80 }).unwrap();
        let store = kv_store(1, 2, 64, 2048, start, 96, 112, 32, 48).unwrap();
        let add = crate::launch::add(128, 128, 144).unwrap();
        vec![add.clone(), store, split, merge, add]
    }

    #[test]
    fn consecutive_steps_change_only_the_positional_launches() {
        assert_eq!(diff(&step(20), &step(20)), Change::None);
        assert_eq!(diff(&step(20), &step(21)), Change::Params(vec![1, 2, 3]));
        // Crossing a span edge changes the split's grid: still an update.
        let (a, b) = (step(255), step(256));
        assert_ne!(a[2].grid, b[2].grid);
        assert_eq!(diff(&a, &b), Change::Params(vec![1, 2, 3]));
    }

    #[test]
    fn another_kernel_block_or_length_is_a_new_structure() {
        let base = step(20);
        let mut other = base.clone();
        other[0].kernel = "kiln_silu_mul_of16".into();
        assert_eq!(diff(&base, &other), Change::Structure);
        let mut other = base.clone();
        other[4].block = [128, 1, 1];
        assert_eq!(diff(&base, &other), Change::Structure);
        assert_eq!(diff(&base, &base[..4]), Change::Structure);
        let mut other = base.clone();
        other[0].args[2] = Arg::I32(64);
        assert_eq!(diff(&base, &other), Change::Params(vec![0]));
    }
}
