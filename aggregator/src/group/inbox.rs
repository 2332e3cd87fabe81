//! The leader's decisions for one round, sans IO: which members' shards and offers it takes,
//! and at the round's end whether the group sums by collective or over HTTP. The leader's
//! tasks (`leader.rs`) carry them out; nothing here waits, sends or reads a clock.

use starling_core::AggregatorId;
use starling_core::tier::PartialReport;
use tokio::sync::oneshot;

use super::HandoffRefusal;

/// A leader's inbox for one round: the members' shards it took (or their offers to sum by
/// collective), until it reports.
#[derive(Debug, Default)]
pub(crate) struct Inbox {
    pub(super) reports: Vec<PartialReport>,
    offers: Vec<Offer>,
    /// Members whose offers were turned down, now handing their sums over HTTP.
    converting: Vec<AggregatorId>,
    closed: bool,
}

/// A member's offer to sum its shard by collective: its report without sums, and where the
/// leader answers with the member's turn (`None`: not by collective this round).
#[derive(Debug)]
pub(crate) struct Offer {
    pub(crate) report: PartialReport,
    pub(crate) turn: oneshot::Sender<Option<u64>>,
}

/// How the group sums a round, decided when the leader closes its inbox.
#[derive(Debug)]
pub(crate) enum Decision {
    /// Every member offered by collective and none handed sums over HTTP: all-reduce.
    Collective(Vec<Offer>),
    /// Merge what came over HTTP; the members that offered by collective (not everyone did)
    /// are turned down, and hand their sums over HTTP into the reopened inbox.
    Merge {
        /// Members' shards taken over HTTP.
        reports: Vec<PartialReport>,
        /// Offers to turn down.
        convert: Vec<Offer>,
    },
}

impl Inbox {
    /// Members in: shards and offers.
    pub(crate) fn members(&self) -> usize {
        self.reports.len() + self.offers.len()
    }

    /// Whether a shard (or offer) speaking for `aggregators` may come in: not once the leader
    /// reported, not twice, and never the leader's own.
    fn admit(
        &self,
        aggregators: &[AggregatorId],
        leader: AggregatorId,
    ) -> Result<(), HandoffRefusal> {
        if self.closed {
            return Err(HandoffRefusal::Closed);
        }
        let here = self
            .reports
            .iter()
            .chain(self.offers.iter().map(|o| &o.report))
            .any(|r| r.aggregators.iter().any(|a| aggregators.contains(a)));
        if here || aggregators.contains(&leader) {
            return Err(HandoffRefusal::Duplicate);
        }
        Ok(())
    }

    /// Takes a member's shard; whether the member was one whose offer was turned down (its
    /// hand-off is then expected, not a sign it left the communicator).
    pub(crate) fn take_report(
        &mut self,
        report: PartialReport,
        leader: AggregatorId,
    ) -> Result<bool, HandoffRefusal> {
        self.admit(&report.aggregators, leader)?;
        let converting = self.converting.iter().any(|a| report.aggregators.contains(a));
        self.reports.push(report);
        Ok(converting)
    }

    /// Takes a member's offer to sum by collective.
    pub(crate) fn take_offer(
        &mut self,
        offer: Offer,
        leader: AggregatorId,
    ) -> Result<(), HandoffRefusal> {
        self.admit(&offer.report.aggregators, leader)?;
        self.offers.push(offer);
        Ok(())
    }

    /// Whether every member whose offer was turned down has handed its sums in.
    pub(crate) fn converted(&self) -> bool {
        self.converting.iter().all(|a| self.reports.iter().any(|r| r.aggregators.contains(a)))
    }

    /// Closes the inbox (later hand-offs are refused) and decides from what is in it, with
    /// `expected` members besides the leader.
    pub(crate) fn close(&mut self, expected: usize) -> Decision {
        self.closed = true;
        let reports = std::mem::take(&mut self.reports);
        let offers = std::mem::take(&mut self.offers);
        if !offers.is_empty() && reports.is_empty() && offers.len() == expected {
            Decision::Collective(offers)
        } else {
            Decision::Merge { reports, convert: offers }
        }
    }

    /// Reopens the inbox for the members whose offers were turned down.
    pub(crate) fn reopen_for(&mut self, converting: Vec<AggregatorId>) {
        self.closed = false;
        self.converting = converting;
    }

    /// Closes it for good and takes the late shards.
    pub(crate) fn close_late(&mut self) -> Vec<PartialReport> {
        self.closed = true;
        std::mem::take(&mut self.reports)
    }
}

#[cfg(test)]
mod tests {
    use starling_core::tensor::SchemaId;
    use starling_core::{DeviceId, ModelVersion};

    use super::*;

    const LEADER: AggregatorId = AggregatorId(1);

    fn report(aggregator: u32) -> PartialReport {
        PartialReport {
            model_version: ModelVersion(0),
            schema_id: SchemaId([0; 32]),
            aggregators: vec![AggregatorId(aggregator)],
            devices: vec![DeviceId(i64::from(aggregator))],
            total_weight: 1,
            sum_hi: vec![],
            sum_lo: vec![],
            metrics: Default::default(),
        }
    }

    fn offer(aggregator: u32) -> (Offer, oneshot::Receiver<Option<u64>>) {
        let (turn, answer) = oneshot::channel();
        (Offer { report: report(aggregator), turn }, answer)
    }

    #[test]
    fn shards_come_in_once_and_never_after_the_report() {
        let mut inbox = Inbox::default();
        assert_eq!(inbox.take_report(report(2), LEADER), Ok(false));
        assert_eq!(inbox.take_report(report(2), LEADER), Err(HandoffRefusal::Duplicate));
        assert_eq!(inbox.take_offer(offer(2).0, LEADER), Err(HandoffRefusal::Duplicate));
        assert_eq!(inbox.take_report(report(1), LEADER), Err(HandoffRefusal::Duplicate));
        assert_eq!(inbox.members(), 1);
        inbox.close(2);
        assert_eq!(inbox.take_report(report(3), LEADER), Err(HandoffRefusal::Closed));
    }

    #[test]
    fn every_member_by_collective_sums_by_collective() {
        let mut inbox = Inbox::default();
        for a in [2, 3] {
            inbox.take_offer(offer(a).0, LEADER).unwrap();
        }
        assert!(matches!(inbox.close(2), Decision::Collective(offers) if offers.len() == 2));
    }

    #[test]
    fn a_member_missing_or_over_http_turns_the_offers_into_hand_offs() {
        // One member offered, one is missing: the offer is turned down.
        let mut inbox = Inbox::default();
        inbox.take_offer(offer(2).0, LEADER).unwrap();
        let Decision::Merge { reports, convert } = inbox.close(2) else { panic!("merge") };
        assert!(reports.is_empty());
        assert_eq!(convert.len(), 1);
        // The turned-down member hands its sums over HTTP into the reopened inbox.
        inbox.reopen_for(vec![AggregatorId(2)]);
        assert!(!inbox.converted());
        assert_eq!(inbox.take_report(report(2), LEADER), Ok(true), "expected, not a departure");
        assert!(inbox.converted());
        assert_eq!(inbox.close_late().len(), 1);
        assert_eq!(inbox.take_report(report(3), LEADER), Err(HandoffRefusal::Closed));
        // One over HTTP, one by collective: merge, and turn the offer down.
        let mut inbox = Inbox::default();
        inbox.take_report(report(2), LEADER).unwrap();
        inbox.take_offer(offer(3).0, LEADER).unwrap();
        let Decision::Merge { reports, convert } = inbox.close(2) else { panic!("merge") };
        assert_eq!((reports.len(), convert.len()), (1, 1));
    }
}
