//! Ranks in several processes: every rank connects to rank 0, which listens on exactly the address
//! it is given (`--master-addr`), sums each all-reduce in rank order and sends the sum back.
//!
//! This replaces burn-collective 0.21's multi-process mode, whose second all-reduce between two
//! processes never returns (its node sync keeps the peers of the first one) and whose servers
//! listen on 0.0.0.0; see `docs/distributed.md`. A rank that exits closes its socket, and the
//! others stop with an error naming it; a rank that stops answering is reported after
//! `trainer.collective_timeout_s`.

use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use super::{Collective, DistributedError};

const HELLO: u8 = 1;
const DATA: u8 = 2;
const ERROR: u8 = 3;
const WELCOME: u8 = 4;
/// Frames larger than this are refused (a corrupt length, not a real tensor).
const MAX_FRAME: u64 = 1 << 36;

enum Links {
    /// Rank 0: a stream to every other rank, index `r - 1`.
    Hub(Vec<TcpStream>),
    /// The others: the stream to rank 0.
    Member(TcpStream),
}

/// One rank's membership in a group of processes.
pub struct TcpGroup {
    rank: usize,
    world: usize,
    links: Links,
    timeout: Duration,
    /// Set once an operation failed: every later one fails the same way.
    failed: Mutex<Option<DistributedError>>,
}

fn write_frame(mut stream: &TcpStream, tag: u8, payload: &[u8]) -> std::io::Result<()> {
    let mut head = [0u8; 9];
    head[0] = tag;
    head[1..].copy_from_slice(&(payload.len() as u64).to_le_bytes());
    stream.write_all(&head)?;
    stream.write_all(payload)?;
    stream.flush()
}

fn read_frame(mut stream: &TcpStream) -> std::io::Result<(u8, Vec<u8>)> {
    let mut head = [0u8; 9];
    stream.read_exact(&mut head)?;
    let len = u64::from_le_bytes(head[1..].try_into().expect("8 bytes"));
    if len > MAX_FRAME {
        return Err(std::io::Error::new(
            ErrorKind::InvalidData,
            format!("frame of {len} bytes"),
        ));
    }
    let mut payload = vec![0u8; len as usize];
    stream.read_exact(&mut payload)?;
    Ok((head[0], payload))
}

fn floats_to_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn bytes_to_floats(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().expect("4 bytes")))
        .collect()
}

/// One rank's side of joining the group.
#[derive(Debug, Clone, Copy)]
struct Handshake {
    rank: usize,
    world: usize,
    addr: SocketAddr,
    timeout: Duration,
    deadline: Instant,
    fingerprint: u64,
}

impl Handshake {
    fn err(&self, message: String) -> DistributedError {
        DistributedError::Transport {
            rank: self.rank,
            message,
        }
    }

    /// Rank 0: listens on `addr` until every other rank has introduced itself with the same world
    /// size and config fingerprint, then welcomes them all.
    fn accept_ranks(&self) -> Result<Links, DistributedError> {
        let Handshake {
            rank,
            world,
            addr,
            timeout,
            deadline,
            fingerprint,
        } = *self;
        let err = |m: String| self.err(m);
        let listener =
            TcpListener::bind(addr).map_err(|e| err(format!("cannot listen on {addr}: {e}")))?;
        listener
            .set_nonblocking(true)
            .map_err(|e| err(e.to_string()))?;
        let mut peers: Vec<Option<TcpStream>> = (1..world).map(|_| None).collect();
        while peers.iter().any(Option::is_none) {
            match listener.accept() {
                Ok((stream, from)) => {
                    stream
                        .set_nonblocking(false)
                        .map_err(|e| err(e.to_string()))?;
                    stream
                        .set_read_timeout(Some(timeout))
                        .map_err(|e| err(e.to_string()))?;
                    let _ = stream.set_nodelay(true);
                    let (tag, hello) = read_frame(&stream)
                        .map_err(|e| err(format!("handshake from {from}: {e}")))?;
                    if tag != HELLO || hello.len() != 16 {
                        return Err(err(format!("{from} did not introduce itself as a rank")));
                    }
                    let r = u32::from_le_bytes(hello[0..4].try_into().expect("4")) as usize;
                    let w = u32::from_le_bytes(hello[4..8].try_into().expect("4")) as usize;
                    let f = u64::from_le_bytes(hello[8..16].try_into().expect("8"));
                    let refuse = if w != world {
                        Some(format!("rank {r} expects {w} ranks, rank 0 has {world}"))
                    } else if f != fingerprint {
                        Some(format!(
                            "rank {r} was started with a different config than rank 0"
                        ))
                    } else if r == 0 || r >= world || peers[r - 1].is_some() {
                        Some(format!("rank {r} is invalid or joined twice"))
                    } else {
                        None
                    };
                    if let Some(reason) = refuse {
                        let _ = write_frame(&stream, ERROR, reason.as_bytes());
                        return Err(err(reason));
                    }
                    peers[r - 1] = Some(stream);
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => {
                    if Instant::now() > deadline {
                        let missing: Vec<String> = peers
                            .iter()
                            .enumerate()
                            .filter(|(_, p)| p.is_none())
                            .map(|(i, _)| (i + 1).to_string())
                            .collect();
                        return Err(DistributedError::Timeout {
                            rank,
                            peer: format!("ranks {} joining at {addr}", missing.join(", ")),
                            seconds: timeout.as_secs(),
                        });
                    }
                    std::thread::sleep(Duration::from_millis(20));
                }
                Err(e) => return Err(err(format!("accepting on {addr}: {e}"))),
            }
        }
        let peers: Vec<TcpStream> = peers.into_iter().map(|p| p.expect("all joined")).collect();
        for p in &peers {
            write_frame(p, WELCOME, &[]).map_err(|e| err(e.to_string()))?;
        }
        Ok(Links::Hub(peers))
    }

    /// Any other rank: connects to rank 0 (retrying until the deadline) and introduces itself.
    fn join_rank0(&self) -> Result<Links, DistributedError> {
        let Handshake {
            rank,
            world,
            addr,
            timeout,
            deadline,
            fingerprint,
        } = *self;
        let err = |m: String| self.err(m);
        let stream = loop {
            match TcpStream::connect_timeout(&addr, Duration::from_secs(2)) {
                Ok(s) => break s,
                Err(e) if Instant::now() > deadline => {
                    return Err(err(format!("cannot reach rank 0 at {addr}: {e}")))
                }
                Err(_) => std::thread::sleep(Duration::from_millis(100)),
            }
        };
        stream
            .set_read_timeout(Some(timeout))
            .map_err(|e| err(e.to_string()))?;
        let _ = stream.set_nodelay(true);
        let mut hello = Vec::with_capacity(16);
        hello.extend((rank as u32).to_le_bytes());
        hello.extend((world as u32).to_le_bytes());
        hello.extend(fingerprint.to_le_bytes());
        write_frame(&stream, HELLO, &hello).map_err(|e| err(e.to_string()))?;
        match read_frame(&stream) {
            Ok((WELCOME, _)) => {}
            Ok((ERROR, reason)) => {
                return Err(err(format!(
                    "rank 0 refused: {}",
                    String::from_utf8_lossy(&reason)
                )))
            }
            Ok(_) => return Err(err("unexpected handshake reply".into())),
            Err(e) => return Err(err(format!("handshake with rank 0 at {addr}: {e}"))),
        }
        Ok(Links::Member(stream))
    }
}

impl TcpGroup {
    /// Joins the group of `world` ranks as `rank`. Rank 0 listens on `addr` and waits for the
    /// others; the others connect to it, retrying until `timeout`. `fingerprint` (of the config)
    /// must match on every rank: ranks started with different configs are refused.
    pub fn connect(
        rank: usize,
        world: usize,
        addr: SocketAddr,
        timeout: Duration,
        fingerprint: u64,
    ) -> Result<Self, DistributedError> {
        let err = |message: String| DistributedError::Transport { rank, message };
        if rank >= world {
            return Err(err(format!("rank {rank} is outside a world of {world}")));
        }
        let deadline = Instant::now() + timeout;
        let handshake = Handshake {
            rank,
            world,
            addr,
            timeout,
            deadline,
            fingerprint,
        };
        let links = if rank == 0 {
            handshake.accept_ranks()?
        } else {
            handshake.join_rank0()?
        };
        Ok(Self {
            rank,
            world,
            links,
            timeout,
            failed: Mutex::new(None),
        })
    }

    /// The error for a failed read or write on the link to `peer`.
    fn link_error(&self, peer: usize, e: std::io::Error) -> DistributedError {
        match e.kind() {
            ErrorKind::WouldBlock | ErrorKind::TimedOut => DistributedError::Timeout {
                rank: self.rank,
                peer: format!("rank {peer}"),
                seconds: self.timeout.as_secs(),
            },
            _ => DistributedError::PeerFailed {
                rank: self.rank,
                reason: format!("rank {peer} disconnected ({e}): it exited or was killed"),
            },
        }
    }

    fn fail(&self, e: DistributedError) -> DistributedError {
        let mut failed = self.failed.lock().unwrap_or_else(|p| p.into_inner());
        if failed.is_none() {
            *failed = Some(e.clone());
            // Tell the others, so they stop now rather than at their timeout.
            let reason = e.to_string();
            match &self.links {
                Links::Hub(peers) => {
                    for p in peers {
                        let _ = write_frame(p, ERROR, reason.as_bytes());
                    }
                }
                Links::Member(hub) => {
                    let _ = write_frame(hub, ERROR, reason.as_bytes());
                }
            }
        }
        e
    }

    fn hub_all_reduce(
        &self,
        peers: &[TcpStream],
        mut sum: Vec<f32>,
    ) -> Result<Vec<f32>, DistributedError> {
        // Rank order, so every run adds in the same order.
        for (i, p) in peers.iter().enumerate() {
            let peer = i + 1;
            let (tag, payload) = read_frame(p).map_err(|e| self.link_error(peer, e))?;
            match tag {
                DATA => {
                    let part = bytes_to_floats(&payload);
                    if part.len() != sum.len() {
                        return Err(DistributedError::Transport {
                            rank: self.rank,
                            message: format!(
                                "rank {peer} sent {} values, rank 0 has {}: the ranks are out of step",
                                part.len(),
                                sum.len()
                            ),
                        });
                    }
                    for (s, x) in sum.iter_mut().zip(part) {
                        *s += x;
                    }
                }
                ERROR => {
                    return Err(DistributedError::PeerFailed {
                        rank: self.rank,
                        reason: String::from_utf8_lossy(&payload).into_owned(),
                    })
                }
                _ => {
                    return Err(DistributedError::Transport {
                        rank: self.rank,
                        message: format!("unexpected frame {tag} from rank {peer}"),
                    })
                }
            }
        }
        let bytes = floats_to_bytes(&sum);
        for (i, p) in peers.iter().enumerate() {
            write_frame(p, DATA, &bytes).map_err(|e| self.link_error(i + 1, e))?;
        }
        Ok(sum)
    }

    fn member_all_reduce(
        &self,
        hub: &TcpStream,
        data: Vec<f32>,
    ) -> Result<Vec<f32>, DistributedError> {
        write_frame(hub, DATA, &floats_to_bytes(&data)).map_err(|e| self.link_error(0, e))?;
        let (tag, payload) = read_frame(hub).map_err(|e| self.link_error(0, e))?;
        match tag {
            DATA => {
                let sum = bytes_to_floats(&payload);
                if sum.len() != data.len() {
                    return Err(DistributedError::Transport {
                        rank: self.rank,
                        message: format!(
                            "rank 0 returned {} values for {}: the ranks are out of step",
                            sum.len(),
                            data.len()
                        ),
                    });
                }
                Ok(sum)
            }
            ERROR => Err(DistributedError::PeerFailed {
                rank: self.rank,
                reason: String::from_utf8_lossy(&payload).into_owned(),
            }),
            _ => Err(DistributedError::Transport {
                rank: self.rank,
                message: format!("unexpected frame {tag} from rank 0"),
            }),
        }
    }
}

impl Collective for TcpGroup {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world(&self) -> usize {
        self.world
    }

    fn all_reduce_sum(&self, data: Vec<f32>) -> Result<Vec<f32>, DistributedError> {
        if let Some(e) = self
            .failed
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
        {
            return Err(e);
        }
        let out = match &self.links {
            Links::Hub(peers) => self.hub_all_reduce(peers, data),
            Links::Member(hub) => self.member_all_reduce(hub, data),
        };
        out.map_err(|e| self.fail(e))
    }

    fn abort(&self, reason: &str) {
        self.fail(DistributedError::PeerFailed {
            rank: self.rank,
            reason: format!("rank {} failed: {reason}", self.rank),
        });
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn free_addr() -> SocketAddr {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap()
    }

    #[test]
    fn three_ranks_sum_in_rank_order_and_a_dead_rank_is_reported() {
        let addr = free_addr();
        let t = Duration::from_secs(20);
        let handles: Vec<_> = (0..3)
            .map(|r| {
                std::thread::spawn(move || {
                    let g = TcpGroup::connect(r, 3, addr, t, 7).unwrap();
                    let s = g.all_reduce_sum(vec![r as f32, 1.0]).unwrap();
                    if r == 2 {
                        // Rank 2 leaves without a word: its socket closes.
                        drop(g);
                        return (s, None);
                    }
                    let e = g.all_reduce_sum(vec![0.0, 0.0]).unwrap_err();
                    (s, Some(e.to_string()))
                })
            })
            .collect();
        for h in handles {
            let (sum, err) = h.join().unwrap();
            assert_eq!(sum, vec![3.0, 3.0]);
            if let Some(e) = err {
                assert!(e.contains("rank 2 disconnected"), "{e}");
            }
        }
    }

    #[test]
    fn a_rank_with_another_config_is_refused() {
        let addr = free_addr();
        let t = Duration::from_secs(20);
        let hub = std::thread::spawn(move || TcpGroup::connect(0, 2, addr, t, 1).map(|_| ()));
        let member = TcpGroup::connect(1, 2, addr, t, 2).map(|_| ());
        let hub = hub.join().unwrap();
        assert!(hub.unwrap_err().to_string().contains("different config"));
        assert!(member.unwrap_err().to_string().contains("refused"));
    }
}
