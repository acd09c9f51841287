//! Where a decode step's time goes: events recorded between the kernel groups
//! of one captured step (inside the graph, so launch overhead is what the real
//! step pays), each group with the bytes it must move, for the roofline table
//! of `lily bench --profile`.

use std::collections::BTreeMap;
use std::sync::Mutex;

use anyhow::{anyhow, Result};
use cudarc::driver::{result::event, sys, CudaStream};

/// One kernel group summed over the layers of a step.
#[derive(Clone, Debug)]
pub struct Section {
    pub name: &'static str,
    /// time per step, microseconds
    pub us: f64,
    /// bytes the group must read and write per step
    pub bytes: u64,
    /// how many times the group ran in the step (layers)
    pub count: usize,
}

/// Events recorded during one capture: (group, bytes, event after it).
#[derive(Default)]
pub struct Marks {
    pub start: Option<sys::CUevent>,
    pub marks: Vec<(&'static str, u64, sys::CUevent)>,
    /// events created before the capture (creating them while a stream
    /// captures is best avoided)
    pool: Vec<sys::CUevent>,
}

fn new_event() -> Result<sys::CUevent> {
    event::create(sys::CUevent_flags::CU_EVENT_DEFAULT).map_err(|e| anyhow!("cuEventCreate: {e:?}"))
}

// SAFETY: the raw events are only touched under the mutex by the thread
// that records and reads them.
unsafe impl Send for Marks {}

pub struct Recorder(pub Mutex<Option<Marks>>);

impl Recorder {
    pub fn new() -> Recorder {
        Recorder(Mutex::new(None))
    }

    /// Record an event on `stream` closing group `name`, when profiling.
    pub fn mark(&self, stream: &CudaStream, name: &'static str, bytes: u64) -> Result<()> {
        let mut g = self.0.lock().unwrap();
        let Some(m) = g.as_mut() else { return Ok(()) };
        let e = m
            .pool
            .pop()
            .ok_or_else(|| anyhow!("profile: more groups than events"))?;
        unsafe { event::record(e, stream.cu_stream()) }
            .map_err(|e| anyhow!("cuEventRecord: {e:?}"))?;
        m.marks.push((name, bytes, e));
        Ok(())
    }

    /// Start recording marks; `groups` bounds how many the step will make.
    /// Call before the capture begins, then record the start with `mark_start`.
    pub fn begin(&self, groups: usize) -> Result<()> {
        let mut m = Marks::default();
        for _ in 0..groups + 1 {
            m.pool.push(new_event()?);
        }
        *self.0.lock().unwrap() = Some(m);
        Ok(())
    }

    pub fn mark_start(&self, stream: &CudaStream) -> Result<()> {
        let mut g = self.0.lock().unwrap();
        let Some(m) = g.as_mut() else { return Ok(()) };
        let e = m
            .pool
            .pop()
            .ok_or_else(|| anyhow!("profile: no event left"))?;
        unsafe { event::record(e, stream.cu_stream()) }
            .map_err(|e| anyhow!("cuEventRecord: {e:?}"))?;
        m.start = Some(e);
        Ok(())
    }

    pub fn take(&self) -> Option<Marks> {
        self.0.lock().unwrap().take()
    }
}

impl Default for Recorder {
    fn default() -> Self {
        Recorder::new()
    }
}

impl Marks {
    /// Per-group times of the last replay (the stream must be synchronised).
    pub fn sections(&self) -> Result<Vec<Section>> {
        let mut out: BTreeMap<&'static str, Section> = BTreeMap::new();
        let mut order = Vec::new();
        let mut prev = self
            .start
            .ok_or_else(|| anyhow!("profile without a start event"))?;
        for &(name, bytes, e) in &self.marks {
            let ms = unsafe { event::elapsed(prev, e) }
                .map_err(|e| anyhow!("cuEventElapsedTime: {e:?}"))?;
            let s = out.entry(name).or_insert_with(|| {
                order.push(name);
                Section {
                    name,
                    us: 0.0,
                    bytes: 0,
                    count: 0,
                }
            });
            s.us += ms as f64 * 1e3;
            s.bytes += bytes;
            s.count += 1;
            prev = e;
        }
        Ok(order.into_iter().map(|n| out[n].clone()).collect())
    }
}

impl Drop for Marks {
    fn drop(&mut self) {
        let marks = self.marks.drain(..).map(|m| m.2).collect::<Vec<_>>();
        for e in self
            .start
            .take()
            .into_iter()
            .chain(marks)
            .chain(self.pool.drain(..))
        {
            unsafe {
                let _ = event::destroy(e);
            }
        }
    }
}

/// Which launches a capture skips, for the ablation profile: the groups of a
/// decode step in order (a group's launches come before its mark), and the
/// one group to leave out.
pub struct Ablation {
    pub order: Vec<&'static str>,
    target: Option<&'static str>,
    /// marks passed so far in this capture
    passed: usize,
}

impl Ablation {
    /// A pass that only records the group order.
    pub fn learn() -> Ablation {
        Ablation {
            order: Vec::new(),
            target: None,
            passed: 0,
        }
    }

    pub fn skip(order: Vec<&'static str>, target: &'static str) -> Ablation {
        Ablation {
            order,
            target: Some(target),
            passed: 0,
        }
    }

    /// Whether the launches before the first mark are skipped.
    pub fn skip_first(&self) -> bool {
        self.target.is_some() && self.order.first() == self.target.as_ref()
    }

    /// A group's mark was recorded: whether the launches up to the next mark
    /// are skipped.
    pub fn passed(&mut self, name: &'static str) -> bool {
        let Some(t) = self.target else {
            self.order.push(name);
            return true;
        };
        self.passed += 1;
        self.order.get(self.passed) == Some(&t)
    }
}

/// Microseconds per replay of `graph`: `reps` replays between two events,
/// the median of three such runs (after one warm-up replay).
pub fn time_graph(
    stream: &CudaStream,
    graph: &cudarc::driver::CudaGraph,
    reps: usize,
) -> Result<f64> {
    let reps = reps.max(1);
    let (a, b) = (new_event()?, new_event()?);
    let run = || -> Result<f64> {
        unsafe { event::record(a, stream.cu_stream()) }
            .map_err(|e| anyhow!("cuEventRecord: {e:?}"))?;
        for _ in 0..reps {
            graph
                .launch()
                .map_err(|e| anyhow!("launching a profile graph: {e:?}"))?;
        }
        unsafe { event::record(b, stream.cu_stream()) }
            .map_err(|e| anyhow!("cuEventRecord: {e:?}"))?;
        stream
            .synchronize()
            .map_err(|e| anyhow!("CUDA error: {e:?}"))?;
        let ms =
            unsafe { event::elapsed(a, b) }.map_err(|e| anyhow!("cuEventElapsedTime: {e:?}"))?;
        Ok(ms as f64 * 1e3 / reps as f64)
    };
    let res = (|| {
        graph
            .launch()
            .map_err(|e| anyhow!("launching a profile graph: {e:?}"))?;
        let mut v = [run()?, run()?, run()?];
        v.sort_by(f64::total_cmp);
        Ok(v[1])
    })();
    unsafe {
        let _ = event::destroy(a);
        let _ = event::destroy(b);
    }
    res
}
