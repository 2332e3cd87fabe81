//! Finding each other through the coordinator: the leader publishes where members reach it
//! (and the group's NCCL id), members look it up; both keep it fresh.

use std::time::Instant;

use starling_core::codec;
use starling_core::tier::GroupRendezvous;

use super::{GroupState, REFRESH_EVERY};
use crate::report::error_text;

impl GroupState {
    /// Keeps the rendezvous fresh: the leader publishes it through the coordinator, members
    /// look it up (every poll until found, then every few seconds, so a restarted leader is
    /// found).
    pub(crate) async fn keep_rendezvous(&self) {
        self.renew_communicator();
        let fresh = self
            .synced
            .lock()
            .expect("synced poisoned")
            .is_some_and(|t| t.elapsed() < REFRESH_EVERY);
        if fresh {
            return;
        }
        let outcome = if self.is_leader() { self.publish().await } else { self.look_up().await };
        match outcome {
            Ok(()) => *self.synced.lock().expect("synced poisoned") = Some(Instant::now()),
            Err(e) => tracing::warn!(group = %self.config.name, error = %e, "group rendezvous"),
        }
    }

    async fn publish(&self) -> Result<(), String> {
        let doc = GroupRendezvous {
            leader: self.me,
            leader_url: self.my_url.clone(),
            world_size: self.config.world_size,
            nccl_id: self.nccl_id.lock().expect("nccl id poisoned").clone(),
        };
        let body = codec::to_vec(&doc).map_err(|e| e.to_string())?;
        let res = self
            .link
            .cbor_request(reqwest::Method::PUT, &self.rendezvous_url())
            .body(body)
            .send()
            .await
            .map_err(|e| e.to_string())?;
        if !res.status().is_success() {
            return Err(error_text(res).await);
        }
        let first = self.rendezvous.lock().expect("rendezvous poisoned").replace(doc).is_none();
        if first {
            tracing::info!(group = %self.config.name, world_size = self.config.world_size, nccl = self.plane.is_some(), "leading the aggregator group");
        }
        Ok(())
    }

    pub(super) async fn look_up(&self) -> Result<(), String> {
        let res = self
            .link
            .http
            .get(self.rendezvous_url())
            .bearer_auth(&self.link.secret)
            .send()
            .await
            .map_err(|e| e.to_string())?;
        if !res.status().is_success() {
            return Err(error_text(res).await);
        }
        let bytes = res.bytes().await.map_err(|e| e.to_string())?;
        let doc: GroupRendezvous = codec::decode(&bytes).map_err(|e| e.to_string())?;
        doc.validate().map_err(|e| e.to_string())?;
        if doc.world_size != self.config.world_size {
            return Err(format!(
                "the leader says the group has {} members, this node was started with {}; reporting alone",
                doc.world_size, self.config.world_size
            ));
        }
        if let (Some(plane), Some(id)) = (&self.plane, &doc.nccl_id) {
            plane.join(id);
        }
        let previous = self.rendezvous.lock().expect("rendezvous poisoned").replace(doc.clone());
        if previous.as_ref() != Some(&doc) {
            tracing::info!(group = %self.config.name, leader = %doc.leader, url = %doc.leader_url, nccl = doc.nccl_id.is_some(), "found the group's leader");
        }
        Ok(())
    }
}
