//! [`HostCollective`]: the ranks are threads of one process and meet in host
//! memory. It is the CPU path of CI (world sizes 1 to 4 on any machine) and a
//! correct, slow fallback for device tensors (staged through the host).
use std::collections::HashMap;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use candle_core::{DType, Device, Result, Tensor};

use crate::collective::{check_gather, check_rank, check_scatter, err, Collective, Member};

/// One rank of a group of threads (see [`HostCollective::group`]).
///
/// ```
/// use candle_core::{Device, Tensor};
/// use streamer_dist::{Collective, HostCollective};
///
/// let ranks = HostCollective::group(3, std::time::Duration::from_secs(10))?;
/// let sums = std::thread::scope(|s| {
///     let handles: Vec<_> = ranks
///         .iter()
///         .map(|c| s.spawn(move || -> candle_core::Result<Vec<f32>> {
///             let x = Tensor::new(&[c.rank() as f32, 1.0], &Device::Cpu)?;
///             c.all_reduce_sum(&x)?.to_vec1::<f32>()
///         }))
///         .collect();
///     handles.into_iter().map(|h| h.join().unwrap()).collect::<candle_core::Result<Vec<_>>>()
/// })?;
/// assert!(sums.iter().all(|s| s == &[3.0, 3.0]));
/// # Ok::<(), candle_core::Error>(())
/// ```
pub struct HostCollective {
    member: Member,
    shared: Arc<Shared>,
    /// This rank's count of operations, the key of its next rendezvous.
    seq: Mutex<u64>,
}

struct Shared {
    state: Mutex<State>,
    arrived: Condvar,
    timeout: Duration,
}

#[derive(Default)]
struct State {
    rounds: HashMap<u64, Round>,
    failed: Option<String>,
}

/// One rendezvous: what each rank brought, and how many have taken the result.
struct Round {
    op: &'static str,
    deposits: Vec<Option<Deposit>>,
    arrived: usize,
    taken: usize,
}

#[derive(Clone)]
struct Deposit {
    tensor: Option<Tensor>,
    /// Shape and dtype the rank called with (checked against rank 0's).
    shape: Vec<usize>,
    dtype: DType,
}

impl HostCollective {
    /// The `world_size` ranks of a new group on the CPU, in rank order. Hand one
    /// to each thread. `timeout` bounds every blocking call.
    pub fn group(world_size: usize, timeout: Duration) -> Result<Vec<Self>> {
        Self::group_on(vec![Device::Cpu; world_size.max(1)], world_size, timeout)
    }

    /// A group whose rank `r` computes on `devices[r]` (device tensors travel
    /// through the host). `devices.len()` must equal `world_size`.
    pub fn group_on(
        devices: Vec<Device>,
        world_size: usize,
        timeout: Duration,
    ) -> Result<Vec<Self>> {
        check_rank(0, world_size)?;
        if devices.len() != world_size {
            candle_core::bail!(
                "streamer-dist: HostCollective::group_on got {} devices for a world of size {world_size}",
                devices.len()
            )
        }
        if timeout.is_zero() {
            candle_core::bail!("streamer-dist: the collective timeout must be positive, got 0")
        }
        let shared = Arc::new(Shared {
            state: Mutex::new(State::default()),
            arrived: Condvar::new(),
            timeout,
        });
        Ok(devices
            .into_iter()
            .enumerate()
            .map(|(rank, device)| Self {
                member: Member {
                    rank,
                    world: world_size,
                    device,
                },
                shared: shared.clone(),
                seq: Mutex::new(0),
            })
            .collect())
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic while holding the lock cannot leave a round half-written (every
        // update is one assignment), so the state is usable after it.
        self.shared.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn fail(&self, st: &mut State, why: String) {
        if st.failed.is_none() {
            st.failed = Some(why);
        }
        self.shared.arrived.notify_all();
    }

    /// Deposits `x` for round `seq`, waits until every rank has, and returns
    /// every rank's deposit in rank order.
    fn exchange(&self, op: &'static str, x: Option<&Tensor>) -> Result<Vec<Option<Tensor>>> {
        let tensor = match x {
            Some(t) => Some(streamer_device::to_device_compact(t, &Device::Cpu)?.contiguous()?),
            None => None,
        };
        let deposit = Deposit {
            shape: x.map(|t| t.dims().to_vec()).unwrap_or_default(),
            dtype: x.map_or(DType::F32, |t| t.dtype()),
            tensor,
        };
        let seq = {
            let mut s = self.seq.lock().unwrap_or_else(|p| p.into_inner());
            *s += 1;
            *s
        };
        let deadline = Instant::now() + self.shared.timeout;
        let mut st = self.lock();
        if let Some(f) = &st.failed {
            return Err(err(
                self.member.rank,
                op,
                format!("the group failed earlier: {f}"),
            ));
        }
        self.deposit(&mut st, op, seq, deposit)?;
        loop {
            if let Some(f) = &st.failed {
                return Err(err(self.member.rank, op, format!("#{seq} aborted: {f}")));
            }
            let round = &st.rounds[&seq];
            if round.arrived == self.member.world {
                break;
            }
            let now = Instant::now();
            if now >= deadline {
                let missing: Vec<usize> = (0..self.member.world)
                    .filter(|&r| round.deposits[r].is_none())
                    .collect();
                let why = format!(
                    "rank {} timed out in {op} (#{seq}) after {:.1} s waiting for ranks {missing:?}",
                    self.member.rank,
                    self.shared.timeout.as_secs_f64()
                );
                self.fail(&mut st, why.clone());
                return Err(err(self.member.rank, op, why));
            }
            st = self
                .shared
                .arrived
                .wait_timeout(st, deadline - now)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
        self.take(&mut st, op, seq)
    }

    fn deposit(&self, st: &mut State, op: &'static str, seq: u64, d: Deposit) -> Result<()> {
        let world = self.member.world;
        let round = st.rounds.entry(seq).or_insert_with(|| Round {
            op,
            deposits: vec![None; world],
            arrived: 0,
            taken: 0,
        });
        let mismatch = if round.op != op {
            Some(format!(
                "called {op} as operation #{seq}, another rank called {}",
                round.op
            ))
        } else {
            round.deposits.iter().flatten().next().and_then(|other| {
                (other.shape != d.shape || other.dtype != d.dtype).then(|| {
                    format!(
                        "{op} #{seq} with shape {:?} {:?}, another rank with {:?} {:?}",
                        d.shape, d.dtype, other.shape, other.dtype
                    )
                })
            })
        };
        if let Some(m) = mismatch {
            let why = format!("rank {}: {m}", self.member.rank);
            self.fail(st, why.clone());
            return Err(err(self.member.rank, op, why));
        }
        round.deposits[self.member.rank] = Some(d);
        round.arrived += 1;
        if round.arrived == world {
            self.shared.arrived.notify_all();
        }
        Ok(())
    }

    fn take(&self, st: &mut State, op: &'static str, seq: u64) -> Result<Vec<Option<Tensor>>> {
        let Some(round) = st.rounds.get_mut(&seq) else {
            return Err(err(
                self.member.rank,
                op,
                format!("internal error: round #{seq} vanished"),
            ));
        };
        let out = round
            .deposits
            .iter()
            .map(|d| d.as_ref().and_then(|d| d.tensor.clone()))
            .collect();
        round.taken += 1;
        if round.taken == self.member.world {
            st.rounds.remove(&seq);
        }
        Ok(out)
    }

    fn tensors(&self, op: &'static str, x: &Tensor) -> Result<Vec<Tensor>> {
        self.exchange(op, Some(x))?
            .into_iter()
            .map(|t| {
                t.ok_or_else(|| err(self.member.rank, op, "internal error: a rank sent nothing"))
            })
            .collect()
    }
}

/// The sum of `parts` in order, in f32 for half types (then cast back).
fn sum_in_order(parts: &[Tensor]) -> Result<Tensor> {
    let dtype = parts[0].dtype();
    let wide = matches!(dtype, DType::BF16 | DType::F16);
    let mut acc = if wide {
        parts[0].to_dtype(DType::F32)?
    } else {
        parts[0].clone()
    };
    for p in &parts[1..] {
        acc = if wide {
            (acc + p.to_dtype(DType::F32)?)?
        } else {
            (acc + p)?
        };
    }
    acc.to_dtype(dtype)
}

impl Collective for HostCollective {
    fn member(&self) -> &Member {
        &self.member
    }

    fn all_reduce_sum(&self, x: &Tensor) -> Result<Tensor> {
        let parts = self.tensors("all_reduce_sum", x)?;
        sum_in_order(&parts)?.to_device(x.device())
    }

    fn reduce_scatter_sum(&self, x: &Tensor) -> Result<Tensor> {
        let n = check_scatter(self.member.rank, self.member.world, x)?;
        let parts = self.tensors("reduce_scatter_sum", x)?;
        let mine = parts
            .iter()
            .map(|p| p.narrow(0, self.member.rank * n, n))
            .collect::<Result<Vec<_>>>()?;
        sum_in_order(&mine)?.to_device(x.device())
    }

    fn all_gather(&self, x: &Tensor) -> Result<Tensor> {
        check_gather(self.member.rank, x)?;
        let parts = self.tensors("all_gather", x)?;
        Tensor::cat(&parts, 0)?.to_device(x.device())
    }

    fn ring_shift(&self, x: &Tensor) -> Result<Tensor> {
        let mut parts = self.tensors("ring_shift", x)?;
        let from = (self.member.rank + self.member.world - 1) % self.member.world;
        parts.swap_remove(from).to_device(x.device())
    }

    fn barrier(&self) -> Result<()> {
        self.exchange("barrier", None).map(|_| ())
    }

    fn abort(&self, reason: &str) {
        let mut st = self.lock();
        self.fail(
            &mut st,
            format!("rank {} failed: {reason}", self.member.rank),
        );
    }

    fn failure(&self) -> Option<String> {
        self.lock().failed.clone()
    }
}
