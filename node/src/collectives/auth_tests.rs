//! The pod data plane admits only members that prove their node key
//! (`PeerAuth::NodeKeys`, the keys the hostfile names): a stranger that
//! introduces itself with a well-formed hello for a member's rank, before
//! the real member, is dropped and the pod forms with the real member; a
//! member never links to a stranger listening at another member's address.

use std::net::{SocketAddr, TcpListener};
use std::sync::Arc;
use std::time::Duration;

use ed25519_dalek::SigningKey;

use super::tcp::{PeerAuth, TcpOptions, TcpTransport};
use super::*;
use crate::identity::Identity;
use crate::pod::hostfile::{PodConfig, PodConfigError};

fn key(seed: u8) -> Arc<Identity> {
    Arc::new(Identity::from_signing_key(SigningKey::from_bytes(
        &[seed; 32],
    )))
}

/// `me` in a pod whose members' keys are `members`' (rank order).
fn auth(me: &Arc<Identity>, members: &[&Arc<Identity>]) -> PeerAuth {
    PeerAuth::NodeKeys {
        identity: Arc::clone(me),
        keys: members
            .iter()
            .map(|m| m.signing_key().verifying_key())
            .collect(),
    }
}

fn listeners(n: usize) -> (Vec<TcpListener>, Vec<SocketAddr>) {
    let ls: Vec<TcpListener> = (0..n)
        .map(|_| TcpListener::bind("127.0.0.1:0").unwrap())
        .collect();
    let addrs = ls.iter().map(|l| l.local_addr().unwrap()).collect();
    (ls, addrs)
}

#[test]
fn a_stranger_with_a_well_formed_hello_but_not_the_members_key_is_dropped() {
    let (k0, k1, stranger_key) = (key(1), key(2), key(3));
    let (ls, addrs) = listeners(3);
    // The pod is ranks 0 and 1; the stranger listens on a port of its own.
    let pod = vec![addrs[0], addrs[1]];
    let opts = TcpOptions {
        timeout: Duration::from_secs(2),
        connect_timeout: Duration::from_secs(20),
        ..TcpOptions::default()
    };
    let mut it = ls.into_iter();
    let (l0, l1, l_stranger) = (it.next().unwrap(), it.next().unwrap(), it.next().unwrap());
    let (a0, auth0) = (pod.clone(), auth(&k0, &[&k0, &k1]));
    let rank0 = std::thread::spawn(move || TcpTransport::connect_with(0, l0, &a0, opts, &auth0));
    // The stranger dials rank 0 first, as rank 1, knows every member's
    // public key and says everything a member says, signing with its own.
    let stranger =
        TcpTransport::connect_with(1, l_stranger, &pod, opts, &auth(&stranger_key, &[&k0, &k1]));
    let (a1, auth1) = (pod.clone(), auth(&k1, &[&k0, &k1]));
    let rank1 = std::thread::spawn(move || TcpTransport::connect_with(1, l1, &a1, opts, &auth1));
    let t0 = rank0.join().unwrap().expect("rank 0 formed");
    let t1 = rank1.join().unwrap().expect("rank 1 formed");
    let mut g: Vec<Box<dyn Collective>> = vec![
        Box::new(Group::new(t0, GroupOptions::default())),
        Box::new(Group::new(t1, GroupOptions::default())),
    ];
    let sums: Vec<Result<Vec<f32>, CollectiveError>> = std::thread::scope(|s| {
        let handles: Vec<_> = g
            .iter_mut()
            .map(|c| {
                s.spawn(move || {
                    let mut v = vec![1.0f32; 16];
                    all_reduce(c.as_mut(), &mut v).map(|()| v)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    drop(stranger);
    for (rank, sum) in sums.iter().enumerate() {
        match sum {
            Ok(v) => assert!(v.iter().all(|x| *x == 2.0), "rank {rank}: {v:?}"),
            Err(e) => panic!("rank {rank} is not linked to the real member: {e}"),
        }
    }
}

/// The other way round: a stranger listening at rank 0's address, as rank
/// 0, cannot prove rank 0's key, so rank 1 never links to it and says why
/// once its connect timeout is spent.
#[test]
fn a_member_does_not_link_to_a_stranger_at_another_members_address() {
    let (k0, k1, stranger_key) = (key(1), key(2), key(3));
    let (ls, pod) = listeners(2);
    let opts = TcpOptions {
        connect_timeout: Duration::from_secs(2),
        ..TcpOptions::default()
    };
    let mut it = ls.into_iter();
    let (l0, l1) = (it.next().unwrap(), it.next().unwrap());
    let (a0, auth0) = (pod.clone(), auth(&stranger_key, &[&k0, &k1]));
    let stranger = std::thread::spawn(move || TcpTransport::connect_with(0, l0, &a0, opts, &auth0));
    let err = TcpTransport::connect_with(1, l1, &pod, opts, &auth(&k1, &[&k0, &k1]))
        .expect_err("rank 1 linked to a stranger at rank 0's address");
    assert!(
        err.to_string().contains("did not prove rank 0's node key"),
        "{err}"
    );
    let _ = stranger.join().unwrap();
}

/// The hostfile names every member's node id, or none; a bad id, a
/// missing one, or this node not being the one named for its rank is a
/// typed error before anything listens.
#[test]
fn the_hostfile_names_every_members_node_id_or_none() {
    let (k0, k1) = (key(1), key(2));
    let hex_of = |k: &Arc<Identity>| hex::encode(k.signing_key().verifying_key().to_bytes());
    let file = |a: &str, b: &str| {
        format!(
            r#"[{{"ssh": "a", "ips": ["127.0.0.1"]{a}}}, {{"ssh": "b", "ips": ["127.0.0.1"]{b}}}]"#
        )
    };
    let named = |k: &Arc<Identity>| format!(r#", "node_id": "{}""#, hex_of(k));
    let both = PodConfig::parse(&file(&named(&k0), &named(&k1))).unwrap();
    assert!(matches!(
        both.peer_auth(1, &k1).unwrap(),
        PeerAuth::NodeKeys { keys, .. } if keys.len() == 2
    ));
    assert!(matches!(
        both.peer_auth(1, &k0),
        Err(PodConfigError::NotThisNode { rank: 1, .. })
    ));
    let none = PodConfig::parse(&file("", "")).unwrap();
    assert!(matches!(none.peer_auth(0, &k0).unwrap(), PeerAuth::Open));
    assert_eq!(
        PodConfig::parse(&file(&named(&k0), "")).unwrap_err(),
        PodConfigError::MissingNodeId { rank: 1 }
    );
    assert_eq!(
        PodConfig::parse(&file(r#", "node_id": "abc""#, &named(&k1))).unwrap_err(),
        PodConfigError::BadNodeId { rank: 0 }
    );
}
