//! The decode step's timeline, from the kernels' trace build (`lily bench
//! --trace`, `kernels::Build::trace`; kernels/common.cuh TRACE):
//! every block of a traced kernel records on the GPU's global timer when it
//! started, when its first PDL wait released it and when it exited. Grouped
//! into launches, that shows where a step's time goes between kernels (the
//! wait for a producer's completion, the work after it), which the in-graph
//! profile (remove a group, time the rest) cannot separate.
//!
//! Launches are recovered from the records alone: every block takes a ticket
//! from one counter as it starts, and a launch (PDL or not) starts no block
//! before every block of the launch before it has started (the next launch
//! begins only once all of them have passed their trigger or exited), so in
//! ticket order each launch's blocks are one run of the same kernel id, even
//! where the timer's ticks are too coarse to order them.
//!
//! The records cost one atomic per block (its result first needed at the
//! exit), a few stores at the exit and a few registers (ptxas, sm_90a: the
//! lm_head gemv and gate/up kernels, held to 80, spill 12 and 24 bytes;
//! gemv3 keeps its 64). Read the times as a picture of the step, and keep
//! speed figures to builds without the trace.

use std::sync::Arc;

use anyhow::{anyhow, Result};
use cudarc::driver::CudaModule;

use crate::gpu::{DevBuf, Gpu};
use crate::kernels::Kernel;

/// Records the ring holds (a power of two): two decode steps of the released
/// model are ~280,000 blocks.
const RING: usize = 1 << 20;

/// One block's record (common.cuh TraceRec): global timer, ns.
#[repr(C)]
#[derive(Clone, Copy, Default, Debug)]
pub struct TraceRec {
    pub t0: u64,
    /// after the first PDL wait (0: the block never waited)
    pub t1: u64,
    pub t2: u64,
    /// at the kernel's TRACE_MARK(LILY_TRACE_MARK) (0: no mark passed)
    pub t3: u64,
    pub kid: u32,
    pub block: u32,
}

/// One launch of the step: its blocks' times in us from the step's start.
#[derive(Clone, Debug)]
pub struct TraceLaunch {
    /// the kernel's name and profile group (its row of the kernel table;
    /// "?" for an unknown id)
    pub kernel: &'static str,
    pub group: &'static str,
    pub blocks: usize,
    pub start: (f64, f64),
    /// (first, last) release from the PDL wait; None if no block waited
    pub wait: Option<(f64, f64)>,
    pub exit: (f64, f64),
    /// (first, last) time a block passed the phase mark; None if none did
    pub mark: Option<(f64, f64)>,
}

/// The ticket counter and the ring every traced module writes to.
pub(crate) struct TraceBufs {
    ticket: DevBuf,
    ring: DevBuf,
}

impl TraceBufs {
    /// Allocate them and give their addresses to every module (its
    /// `__constant__` lily_trace_ticket, lily_trace_ring, lily_trace_mask).
    pub(crate) fn new(gpu: &Gpu, modules: &[Arc<CudaModule>]) -> Result<TraceBufs> {
        let ticket = gpu.alloc(4)?;
        gpu.zero(ticket.ptr, 4)?;
        let ring = gpu.alloc(RING * std::mem::size_of::<TraceRec>())?;
        for m in modules {
            let global = |name: &str| -> Result<u64> {
                use cudarc::driver::DevicePtr;
                let v = m
                    .get_global(name, &gpu.stream)
                    .map_err(|e| anyhow!("the trace build: {name}: {e:?}"))?;
                let p = v.device_ptr(&gpu.stream).0;
                Ok(p)
            };
            gpu.upload(global("lily_trace_ticket")?, &[ticket.ptr])?;
            gpu.upload(global("lily_trace_ring")?, &[ring.ptr])?;
            gpu.upload(global("lily_trace_mask")?, &[(RING - 1) as u32])?;
        }
        gpu.sync()?;
        Ok(TraceBufs { ticket, ring })
    }
}

impl Gpu {
    /// Empty the ring (the next block takes ticket 0).
    pub fn trace_clear(&self) -> Result<()> {
        if let Some(t) = &self.trace {
            self.zero(t.ticket.ptr, 4)?;
        }
        self.sync()
    }

    /// The records the ring holds (the latest RING), in ticket order: the
    /// order the blocks started in.
    pub fn trace_records(&self) -> Result<Vec<TraceRec>> {
        let Some(t) = &self.trace else {
            return Ok(Vec::new());
        };
        let n = self.download::<u32>(t.ticket.ptr, 1)?[0] as usize;
        let ring: Vec<TraceRec> = self.download(t.ring.ptr, n.min(RING))?;
        Ok(if n <= RING {
            ring
        } else {
            let split = n % RING;
            [&ring[split..], &ring[..split]].concat()
        })
    }
}

/// The launches of the last decode step in `recs` (in ticket order, as
/// `trace_records` gives them; from the step's first kernel, its embedding
/// lookup, to the end), in order.
pub fn last_step(recs: &[TraceRec]) -> Vec<TraceLaunch> {
    let embed = Kernel::Embed.info().trace;
    let Some(first) = recs.iter().rposition(|x| x.kid == embed) else {
        return Vec::new();
    };
    let r = &recs[first..];
    let t = r.iter().map(|x| x.t0).min().unwrap();
    let us = |ns: u64| ns.saturating_sub(t) as f64 / 1e3;
    let mut out = Vec::new();
    let mut i = 0;
    while i < r.len() {
        let mut j = i;
        while j < r.len() && r[j].kid == r[i].kid {
            j += 1;
        }
        let g = &r[i..j];
        let min_max = |f: &dyn Fn(&TraceRec) -> u64| {
            let v = g.iter().map(f);
            (us(v.clone().min().unwrap()), us(v.max().unwrap()))
        };
        let first_last = |f: &dyn Fn(&TraceRec) -> u64| {
            let v: Vec<u64> = g.iter().map(f).filter(|&x| x > 0).collect();
            (!v.is_empty()).then(|| (us(*v.iter().min().unwrap()), us(*v.iter().max().unwrap())))
        };
        out.push(TraceLaunch {
            kernel: Kernel::traced(r[i].kid).map_or("?", |k| k.info().name),
            group: Kernel::traced(r[i].kid).map_or("?", |k| k.info().group),
            blocks: g.len(),
            start: min_max(&|x| x.t0),
            wait: first_last(&|x| x.t1),
            exit: min_max(&|x| x.t2),
            mark: first_last(&|x| x.t3),
        });
        i = j;
    }
    out
}

/// The launches as CSV (one row each; times in us from the step's start).
pub fn launches_csv(launches: &[TraceLaunch]) -> String {
    let mut s = String::from(
        "launch,kernel,group,blocks,first_start,last_start,first_wait,last_wait,first_exit,last_exit,first_mark,last_mark\n",
    );
    let pair = |p: Option<(f64, f64)>| {
        p.map_or((String::new(), String::new()), |(a, b)| {
            (format!("{a:.3}"), format!("{b:.3}"))
        })
    };
    for (i, l) in launches.iter().enumerate() {
        let ((w0, w1), (m0, m1)) = (pair(l.wait), pair(l.mark));
        s += &format!(
            "{i},{},{},{},{:.3},{:.3},{w0},{w1},{:.3},{:.3},{m0},{m1}\n",
            l.kernel, l.group, l.blocks, l.start.0, l.start.1, l.exit.0, l.exit.1
        );
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(kid: u32, block: u32, t0: u64, t1: u64, t2: u64) -> TraceRec {
        TraceRec {
            t0,
            t1,
            t2,
            t3: 0,
            kid,
            block,
        }
    }

    #[test]
    fn the_last_step_splits_into_launches() {
        let recs = [
            // an earlier step, then the last one: embed, two gemv3 blocks,
            // then the core, whose blocks start before gemv3's exit (PDL)
            rec(1, 0, 100, 110, 120),
            rec(2, 0, 130, 140, 150),
            rec(1, 0, 1_000, 1_010, 1_100),
            rec(2, 1, 1_050, 1_120, 2_000),
            rec(2, 0, 1_040, 1_110, 2_100),
            TraceRec {
                t3: 2_400,
                ..rec(3, 0, 1_900, 2_200, 2_600)
            },
            TraceRec {
                t3: 2_300,
                ..rec(3, 1, 1_950, 0, 2_500)
            },
        ];
        let l = last_step(&recs);
        assert_eq!(l.len(), 3);
        assert_eq!((l[0].kernel, l[0].blocks), ("embed_kernel", 1));
        assert_eq!((l[1].kernel, l[1].blocks), ("gemv3_kernel", 2));
        assert_eq!(l[1].start, (0.04, 0.05));
        assert_eq!(l[1].wait, Some((0.11, 0.12)));
        assert_eq!(l[1].exit, (1.0, 1.1));
        assert_eq!(l[2].kernel, "gdn_decode_kernel");
        assert_eq!(l[2].wait, Some((1.2, 1.2)));
        assert_eq!((l[1].mark, l[2].mark), (None, Some((1.3, 1.4))));
        let csv = launches_csv(&l);
        assert_eq!(
            csv.lines().nth(3).unwrap(),
            "2,gdn_decode_kernel,gdn core,2,0.900,0.950,1.200,1.200,1.500,1.600,1.300,1.400"
        );
        assert!(csv.lines().nth(2).unwrap().ends_with(",1.000,1.100,,"));
    }

    #[test]
    fn equal_start_times_stay_in_ticket_order() {
        // down's last block and the next layer's first in-proj block start
        // in the same timer tick: the tickets keep the launches apart
        let recs = [
            rec(1, 0, 1_000, 1_010, 1_100),
            rec(7, 0, 1_500, 1_600, 2_400),
            rec(7, 1, 2_000, 2_000, 2_300),
            rec(2, 0, 2_000, 2_400, 3_000),
            rec(2, 1, 2_500, 2_500, 3_100),
        ];
        let l = last_step(&recs);
        let names: Vec<_> = l.iter().map(|x| (x.kernel, x.blocks)).collect();
        assert_eq!(
            names,
            [
                ("embed_kernel", 1),
                ("moe_down_norm_kernel", 2),
                ("gemv3_kernel", 2)
            ]
        );
    }

    #[test]
    fn no_embed_no_step() {
        assert!(last_step(&[rec(2, 0, 1, 2, 3)]).is_empty());
    }
}
