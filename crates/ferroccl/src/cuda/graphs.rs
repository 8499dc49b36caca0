//! Kernels relaunched through one-node CUDA graphs, for a cheaper host launch.
//!
//! Why: the driver's launch is most of what a host call costs (docs/PERFORMANCE.md sections 42
//! and 50), and on the lent H200 machines a `cuGraphLaunch` of an instantiated one-node graph
//! returns in 1.05-1.8 us where `cuLaunchKernelEx` of the same kernel takes 2.4-3.3
//! (`bench/probes/launch_cost.cu`). So a launch outside a stream capture may go through a graph
//! kept for its kernel and grid: relaunched as it is when its parameter is the last launch's,
//! else with its node's parameter set first (0.65-0.7 us more: still under a launch).
//!
//! The price: a graph's node cannot start early behind the kernel ahead of it (the driver refuses
//! the programmatic-serialization attribute on a node), and a graph's launches run one after the
//! other whatever streams they name (a communicator orders its launches so anyway).

use super::device::{Gpu, Kernel, LaunchDims};
use super::{cu_ok, Result};
use cudarc::driver::sys;
use std::any::Any;
use std::ffi::c_void;

/// Graphs one communicator keeps at most: one per kernel and grid it launches (a training
/// loop's shapes take a handful). The least recently used goes first.
pub const MAX_GRAPHS: usize = 32;

/// The launch a graph repeats: its kernel and geometry (the parameter may change).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
struct Shape {
    f: sys::CUfunction,
    grid: (u32, u32, u32),
    block: (u32, u32, u32),
    shared: u32,
}

/// A graph of one kernel node, instantiated.
struct Graph {
    graph: sys::CUgraph,
    exec: sys::CUgraphExec,
    node: sys::CUgraphNode,
}

/// What a launch through the graphs does (and did, for the tests).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum GraphLaunch {
    /// A new graph for the launch's shape (and, with `MAX_GRAPHS` kept, the least recently used
    /// one destroyed).
    Made,
    /// The shape's graph, its node given the new parameter first.
    Reset,
    /// The shape's graph as it was.
    Again,
}

/// Which graph each launch takes: the policy, apart from the driver's calls. `H` is what a
/// graph holds (the driver's handles; anything in the tests).
struct Slots<H> {
    slots: Vec<Slot<H>>,
    tick: u64,
}

struct Slot<H> {
    shape: Shape,
    held: H,
    /// The parameter the graph's node holds now (of its kernel's type).
    param: Box<dyn Any + Send>,
    used: u64,
}

impl<H> Slots<H> {
    fn new() -> Slots<H> {
        Slots {
            slots: Vec::new(),
            tick: 0,
        }
    }

    /// The launch `shape` with `param` takes, and the slot of its graph (for `Made`: none yet).
    fn pick<P: PartialEq + 'static>(&mut self, shape: &Shape, param: &P) -> (GraphLaunch, usize) {
        self.tick += 1;
        match self.slots.iter().position(|s| s.shape == *shape) {
            Some(i) => {
                let slot = &mut self.slots[i];
                slot.used = self.tick;
                match slot.param.downcast_ref::<P>() == Some(param) {
                    true => (GraphLaunch::Again, i),
                    false => (GraphLaunch::Reset, i),
                }
            }
            None => (GraphLaunch::Made, usize::MAX),
        }
    }

    /// After a `Reset`: slot `i`'s node holds `param` now.
    fn reset<P: Send + 'static>(&mut self, i: usize, param: P) {
        self.slots[i].param = Box::new(param);
    }

    /// After a `Made`: keeps the new graph, and gives back the least recently used one when
    /// `MAX_GRAPHS` were kept. Returns the new graph's slot.
    fn keep<P: Send + 'static>(&mut self, shape: Shape, held: H, param: P) -> (usize, Option<H>) {
        let gone = match self.slots.len() >= MAX_GRAPHS {
            true => {
                let oldest = (0..self.slots.len())
                    .min_by_key(|&i| self.slots[i].used)
                    .expect("full");
                Some(self.slots.swap_remove(oldest).held)
            }
            false => None,
        };
        self.slots.push(Slot {
            shape,
            held,
            param: Box::new(param),
            used: self.tick,
        });
        (self.slots.len() - 1, gone)
    }
}

/// One GPU's graphs, by launch shape. Not shared: its owner serialises the launches.
pub struct KernelGraphs {
    gpu: Gpu,
    slots: Slots<Graph>,
}

// SAFETY: the graph handles are context-wide; every use binds the context first, and the owner
// keeps the set behind a lock.
unsafe impl Send for KernelGraphs {}

impl KernelGraphs {
    /// None yet, on `gpu`.
    pub fn new(gpu: Gpu) -> KernelGraphs {
        KernelGraphs {
            gpu,
            slots: Slots::new(),
        }
    }

    /// Graphs kept now.
    pub fn len(&self) -> usize {
        self.slots.slots.len()
    }

    /// Whether none is kept.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Launches `kernel` with `param` on `stream` through the graph of its shape, made on first
    /// use. `dims.overlap_prior` is not honoured (a node cannot start early). None: no graph
    /// could be made (the driver refused one), nothing was launched.
    ///
    /// # Safety
    /// As [`Kernel::launch`]: `param` is the kernel's only parameter, of its type, and every
    /// pointer in it valid on this GPU when the launch runs. The kernel's module outlives these
    /// graphs. The stream is not capturing (a capture records a launch, not a graph's).
    pub unsafe fn launch<P: Copy + PartialEq + Send + 'static>(
        &mut self,
        kernel: &Kernel<'_>,
        dims: LaunchDims,
        stream: sys::CUstream,
        param: &P,
    ) -> Result<Option<GraphLaunch>> {
        self.gpu.bind()?;
        let shape = Shape {
            f: kernel.raw(),
            grid: dims.grid,
            block: dims.block,
            shared: dims.shared_bytes,
        };
        let mut local = *param;
        let mut params = [&mut local as *mut P as *mut c_void];
        let np = sys::CUDA_KERNEL_NODE_PARAMS {
            func: shape.f,
            gridDimX: shape.grid.0,
            gridDimY: shape.grid.1,
            gridDimZ: shape.grid.2,
            blockDimX: shape.block.0,
            blockDimY: shape.block.1,
            blockDimZ: shape.block.2,
            sharedMemBytes: shape.shared,
            kernelParams: params.as_mut_ptr(),
            extra: std::ptr::null_mut(),
            kern: std::ptr::null_mut(),
            // The current context (bound above).
            ctx: std::ptr::null_mut(),
        };
        let (what, mut at) = self.slots.pick(&shape, param);
        match what {
            GraphLaunch::Again => {}
            GraphLaunch::Reset => {
                let g = &self.slots.slots[at].held;
                // SAFETY: our graph's exec and node; the parameter is copied by the call and
                // affects only later launches (one in flight keeps its own).
                cu_ok("cuGraphExecKernelNodeSetParams", unsafe {
                    sys::cuGraphExecKernelNodeSetParams_v2(g.exec, g.node, &np)
                })?;
                self.slots.reset(at, *param);
            }
            GraphLaunch::Made => {
                let made = match make(&np) {
                    Ok(g) => g,
                    Err(e) => {
                        // Nothing launched: the caller launches the kernel itself.
                        tracing::debug!("no graph for a kernel launch: {e}");
                        return Ok(None);
                    }
                };
                let (i, gone) = self.slots.keep(shape, made, *param);
                at = i;
                if let Some(g) = gone {
                    destroy(g);
                }
            }
        }
        let exec = self.slots.slots[at].held.exec;
        // SAFETY: our instantiated graph; the stream is the caller's live, uncaptured stream.
        cu_ok("cuGraphLaunch", unsafe { sys::cuGraphLaunch(exec, stream) })?;
        Ok(Some(what))
    }
}

/// A graph of one kernel node with `np`'s launch, instantiated.
fn make(np: &sys::CUDA_KERNEL_NODE_PARAMS) -> Result<Graph> {
    let mut graph = std::ptr::null_mut();
    // SAFETY: an out pointer; flags must be 0.
    cu_ok("cuGraphCreate", unsafe {
        sys::cuGraphCreate(&mut graph, 0)
    })?;
    let mut node = std::ptr::null_mut();
    let mut exec = std::ptr::null_mut();
    // SAFETY: our new graph, no dependencies; the parameter is copied into the node.
    let made = cu_ok("cuGraphAddKernelNode", unsafe {
        sys::cuGraphAddKernelNode_v2(&mut node, graph, std::ptr::null(), 0, np)
    })
    .and_then(|()| {
        // SAFETY: a complete graph; an out pointer.
        cu_ok("cuGraphInstantiateWithFlags", unsafe {
            sys::cuGraphInstantiateWithFlags(&mut exec, graph, 0)
        })
    });
    if let Err(e) = made {
        // SAFETY: our graph, never instantiated.
        unsafe { sys::cuGraphDestroy(graph) };
        return Err(e);
    }
    Ok(Graph { graph, exec, node })
}

/// Destroys a graph whose launches may still run: the driver frees an exec in flight once it
/// completes.
fn destroy(g: Graph) {
    // SAFETY: ours.
    unsafe {
        sys::cuGraphExecDestroy(g.exec);
        sys::cuGraphDestroy(g.graph);
    }
}

impl Drop for KernelGraphs {
    fn drop(&mut self) {
        if self.slots.slots.is_empty() {
            return;
        }
        let _ = self.gpu.bind();
        for s in self.slots.slots.drain(..) {
            destroy(s.held);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape(f: usize, blocks: u32) -> Shape {
        Shape {
            f: f as sys::CUfunction,
            grid: (blocks, 1, 1),
            block: (512, 1, 1),
            shared: 0,
        }
    }

    #[test]
    fn a_shape_gets_one_graph_reset_only_for_a_new_parameter() {
        let mut s: Slots<u32> = Slots::new();
        let a = shape(0x100, 1);
        assert_eq!(s.pick(&a, &7u64).0, GraphLaunch::Made);
        let (i, gone) = s.keep(a, 1, 7u64);
        assert_eq!((i, gone), (0, None));
        assert_eq!(s.pick(&a, &7u64), (GraphLaunch::Again, 0));
        // A new buffer: the same graph, its node reset.
        assert_eq!(s.pick(&a, &8u64), (GraphLaunch::Reset, 0));
        s.reset(0, 8u64);
        assert_eq!(s.pick(&a, &8u64), (GraphLaunch::Again, 0));
        // The same bits in a parameter of another type are not the same parameter.
        assert_eq!(s.pick(&a, &8i64), (GraphLaunch::Reset, 0));
        // Another grid or kernel is another graph.
        assert_eq!(s.pick(&shape(0x100, 2), &8u64).0, GraphLaunch::Made);
        assert_eq!(s.pick(&shape(0x200, 1), &8u64).0, GraphLaunch::Made);
        assert_eq!(s.slots.len(), 1);
    }

    #[test]
    fn the_least_recently_used_graph_goes_when_the_set_is_full() {
        let mut s: Slots<usize> = Slots::new();
        for k in 0..MAX_GRAPHS {
            let sh = shape(0x100 + k, 1);
            assert_eq!(s.pick(&sh, &0u8).0, GraphLaunch::Made);
            assert_eq!(s.keep(sh, k, 0u8).1, None);
        }
        // The first shape used again: the second is now the oldest.
        assert_eq!(s.pick(&shape(0x100, 1), &0u8).0, GraphLaunch::Again);
        let next = shape(0x100 + MAX_GRAPHS, 1);
        assert_eq!(s.pick(&next, &0u8).0, GraphLaunch::Made);
        let (_, gone) = s.keep(next, MAX_GRAPHS, 0u8);
        assert_eq!(gone, Some(1), "the least recently used graph is given back");
        assert_eq!(s.slots.len(), MAX_GRAPHS);
        assert_eq!(s.pick(&shape(0x100, 1), &0u8).0, GraphLaunch::Again);
        assert_eq!(s.pick(&shape(0x101, 1), &0u8).0, GraphLaunch::Made);
        assert_eq!(s.pick(&next, &0u8).0, GraphLaunch::Again);
    }
}
