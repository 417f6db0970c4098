//! What every SQL backend writes the same way: each [`super::Store`] and
//! [`super::StoreTx`] method a call of the backend's own function of the
//! same name in its `jobs`, `nodes`, `ledger`, `keys`, `audits` and `leases`
//! modules.
//!
//! The macros expand inside a backend's `impl Store` / `impl StoreTx`
//! (after the methods it writes itself: `close`, `ping`, `durability`,
//! `write`), where these names resolve: the modules, `now_ms`, the domain
//! types, `self.conn()` (a pool connection), `self.begin()` (a
//! transition's own transaction) and `conn(tx)` (a write transaction's
//! connection).

/// The distinct nodes of a batch of picks `(job, attempt, node)`, sorted.
pub(super) fn nodes_of(picks: &[(mlxnet_proto::ids::JobId, u32, String)]) -> Vec<&str> {
    let mut nodes: Vec<&str> = picks.iter().map(|(_, _, n)| n.as_str()).collect();
    nodes.sort_unstable();
    nodes.dedup();
    nodes
}

/// The [`super::Store`] methods from `insert_job` on.
macro_rules! store_methods {
    () => {
        async fn insert_job(&self, job: &NewJob) -> Result<JobRecord> {
            let now = now_ms();
            jobs::insert(&mut *self.conn().await?, &[(job, now)]).await?;
            Ok(JobRecord::queued(job, now))
        }

        async fn get_job(&self, id: JobId) -> Result<Option<JobRecord>> {
            jobs::get(&mut *self.conn().await?, id).await
        }

        async fn list_jobs(&self, limit: u32) -> Result<Vec<JobRecord>> {
            jobs::list(&mut *self.conn().await?, limit).await
        }

        async fn queued_jobs(&self, limit: u32) -> Result<Vec<JobRecord>> {
            jobs::queued(&mut *self.conn().await?, limit).await
        }

        async fn job_accounts(&self, ids: &[JobId]) -> Result<HashMap<JobId, String>> {
            jobs::accounts(&mut *self.conn().await?, ids).await
        }

        async fn count_queued(&self) -> Result<u64> {
            jobs::count_queued(&mut *self.conn().await?).await
        }

        async fn job_stats(&self) -> Result<JobStats> {
            jobs::stats(&mut *self.conn().await?).await
        }

        async fn assign(&self, id: JobId, attempt: u32, node_id: &str) -> Result<bool> {
            let mut tx = self.begin().await?;
            jobs::lock_nodes(&mut tx, &[node_id]).await?;
            let done = jobs::assign(&mut tx, id, attempt, node_id, now_ms()).await?;
            tx.commit().await?;
            Ok(done)
        }

        async fn assign_many(&self, batch: &[(JobId, u32, String)]) -> Result<Vec<bool>> {
            let now = now_ms();
            let mut tx = self.begin().await?;
            jobs::lock_nodes(&mut tx, &super::backend::nodes_of(batch)).await?;
            let mut done = Vec::with_capacity(batch.len());
            for (id, attempt, node_id) in batch {
                done.push(jobs::assign(&mut tx, *id, *attempt, node_id, now).await?);
            }
            tx.commit().await?;
            Ok(done)
        }

        async fn claim_queued<F>(&self, limit: u32, place: F) -> Result<Vec<bool>>
        where
            F: FnOnce(Vec<(JobRecord, Option<String>)>) -> Vec<(JobId, u32, String)> + Send,
        {
            let mut tx = self.begin().await?;
            let claimed = jobs::claim(&mut tx, limit).await?;
            let picks = place(claimed);
            jobs::lock_nodes(&mut tx, &super::backend::nodes_of(&picks)).await?;
            let now = now_ms();
            let mut done = Vec::with_capacity(picks.len());
            for (id, attempt, node_id) in &picks {
                done.push(jobs::assign(&mut tx, *id, *attempt, node_id, now).await?);
            }
            tx.commit().await?;
            Ok(done)
        }

        async fn mark_running(&self, id: JobId, attempt: u32, node_id: &str) -> Result<bool> {
            let mut tx = self.begin().await?;
            let done = jobs::mark_running(&mut tx, id, attempt, node_id, now_ms()).await?;
            tx.commit().await?;
            Ok(done)
        }

        async fn complete(&self, c: &Completion) -> Result<bool> {
            let mut tx = self.begin().await?;
            let done = jobs::complete(&mut tx, c, now_ms()).await?;
            tx.commit().await?;
            Ok(done)
        }

        async fn end_attempt_streamed(
            &self,
            end: &StreamedEnd<'_>,
            segment: &Segment,
        ) -> Result<Option<AttemptEnd>> {
            let mut tx = self.begin().await?;
            let ended = jobs::end_attempt(&mut tx, end, segment, now_ms()).await?;
            tx.commit().await?;
            Ok(ended)
        }

        async fn segments(&self, job: JobId) -> Result<Vec<Segment>> {
            jobs::segments(&mut *self.conn().await?, job).await
        }

        async fn cancel(&self, id: JobId) -> Result<CancelOutcome> {
            let mut tx = self.begin().await?;
            let outcome = jobs::cancel(&mut tx, id, now_ms()).await?;
            tx.commit().await?;
            Ok(outcome)
        }

        async fn requeue_orphans(
            &self,
            max_attempts: u32,
            me: Option<&str>,
            now_ms: i64,
        ) -> Result<u64> {
            let mut tx = self.begin().await?;
            let n = leases::requeue_orphans(&mut tx, max_attempts, me, now_ms).await?;
            tx.commit().await?;
            Ok(n)
        }

        async fn upsert_node(&self, node: &NodeRecord, replica: &str) -> Result<()> {
            nodes::upsert(&mut *self.conn().await?, node, replica, now_ms()).await
        }

        async fn touch_node(&self, id: &str) -> Result<()> {
            nodes::touch(&mut *self.conn().await?, id, now_ms()).await
        }

        async fn set_node_offline(&self, id: &str) -> Result<()> {
            nodes::set_offline(&mut *self.conn().await?, id).await
        }

        async fn mark_all_nodes_offline(&self) -> Result<()> {
            nodes::all_offline(&mut *self.conn().await?).await
        }

        async fn get_node(&self, id: &str) -> Result<Option<(NodeRecord, String)>> {
            nodes::get(&mut *self.conn().await?, id).await
        }

        async fn count_nodes(&self) -> Result<u64> {
            nodes::count(&mut *self.conn().await?).await
        }

        async fn insert_account(&self, account: &Account) -> Result<()> {
            ledger::insert_account(&mut *self.conn().await?, account, false).await
        }

        async fn account(&self, id: &str) -> Result<Option<Account>> {
            ledger::account(&mut *self.conn().await?, id).await
        }

        async fn transfer(&self, id: &str) -> Result<Option<Transfer>> {
            ledger::transfer(&mut *self.conn().await?, id).await
        }

        async fn job_terms(&self, job: &str) -> Result<Option<JobTerms>> {
            ledger::job_terms(&mut *self.conn().await?, job).await
        }

        async fn jobs_of(&self, account: &str, limit: u32) -> Result<Vec<String>> {
            ledger::jobs_of(&mut *self.conn().await?, account, limit).await
        }

        async fn history(&self, account: &str, limit: u32) -> Result<Vec<Transfer>> {
            ledger::history(&mut *self.conn().await?, account, limit).await
        }

        async fn job_transfers(&self, job: &str) -> Result<Vec<Transfer>> {
            ledger::job_transfers(&mut *self.conn().await?, job).await
        }

        async fn earnings(&self, account: &str, since_ms: i64) -> Result<Vec<NodeEarnings>> {
            ledger::earnings(&mut *self.conn().await?, account, since_ms).await
        }

        async fn nodes_of(&self, account: &str) -> Result<Vec<String>> {
            ledger::nodes_of(&mut *self.conn().await?, account).await
        }

        async fn totals(&self) -> Result<Totals> {
            ledger::totals(&mut *self.conn().await?).await
        }

        async fn balance_mismatches(&self) -> Result<Vec<String>> {
            ledger::balance_mismatches(&mut *self.conn().await?).await
        }

        async fn ledger_anomalies(
            &self,
            now_ms: i64,
            audit_window_ms: i64,
        ) -> Result<Vec<(Anomaly, String)>> {
            ledger::anomalies(&mut *self.conn().await?, now_ms, audit_window_ms).await
        }

        async fn due_holds(&self, now_ms: i64, limit: u32) -> Result<Vec<String>> {
            ledger::due_holds(&mut *self.conn().await?, now_ms, limit).await
        }

        async fn unsettled_jobs(
            &self,
            now_ms: i64,
            audit_window_ms: i64,
            limit: u32,
        ) -> Result<Vec<String>> {
            ledger::unsettled_jobs(&mut *self.conn().await?, now_ms, audit_window_ms, limit).await
        }

        async fn record_online(
            &self,
            epoch: i64,
            node_id: &str,
            memory_bytes: u64,
            online_ms: u64,
        ) -> Result<()> {
            ledger::record_online(
                &mut *self.conn().await?,
                epoch,
                node_id,
                memory_bytes,
                online_ms,
            )
            .await
        }

        async fn unpaid_epochs(&self, current: i64) -> Result<Vec<i64>> {
            ledger::unpaid_epochs(&mut *self.conn().await?, current).await
        }

        async fn insert_key(&self, key: &NewKey) -> Result<bool> {
            keys::insert(&mut *self.conn().await?, key).await
        }

        async fn key_by_hash(&self, hash: &[u8; 32], now_ms: i64) -> Result<Option<StoredKey>> {
            keys::by_hash(&mut *self.conn().await?, hash, now_ms).await
        }

        async fn set_key_limits(&self, key_id: &str, limits: KeyLimits) -> Result<bool> {
            keys::set_limits(&mut *self.conn().await?, key_id, limits).await
        }

        async fn revoke_key(
            &self,
            key_id: &str,
            account: Option<&str>,
            now_ms: i64,
        ) -> Result<bool> {
            keys::revoke(&mut *self.conn().await?, key_id, account, now_ms).await
        }

        async fn list_keys(&self, account: &str) -> Result<Vec<KeyInfo>> {
            keys::list(&mut *self.conn().await?, account).await
        }

        async fn banned_nodes(&self) -> Result<Vec<String>> {
            audits::banned(&mut *self.conn().await?).await
        }

        async fn audit_record(&self, node: &str) -> Result<AuditRecord> {
            audits::record(&mut *self.conn().await?, node).await
        }

        async fn node_records(&self) -> Result<Vec<(String, AuditRecord)>> {
            audits::records(&mut *self.conn().await?).await
        }

        async fn count_record(&self, node: &str, delta: &RecordDelta) -> Result<()> {
            audits::count(&mut *self.conn().await?, node, delta).await
        }

        async fn begin_audit(&self, job: &str, node: &str, now_ms: i64) -> Result<bool> {
            audits::begin(&mut *self.conn().await?, job, node, now_ms).await
        }

        async fn miss_audit(&self, job: &str, now_ms: i64) -> Result<()> {
            audits::miss(&mut *self.conn().await?, job, now_ms).await
        }

        async fn audit_state(&self, job: &str) -> Result<Option<String>> {
            audits::state(&mut *self.conn().await?, job).await
        }

        async fn acquire_lease(
            &self,
            name: &str,
            holder: &str,
            ttl_ms: i64,
            now_ms: i64,
        ) -> Result<Option<Lease>> {
            let mut tx = self.begin().await?;
            let lease = leases::acquire(&mut tx, name, holder, ttl_ms, now_ms).await?;
            tx.commit().await?;
            Ok(lease)
        }

        async fn release_lease(&self, lease: &Lease) -> Result<bool> {
            let mut tx = self.begin().await?;
            let released = leases::release(&mut tx, lease).await?;
            tx.commit().await?;
            Ok(released)
        }

        async fn lease(&self, name: &str) -> Result<Option<Lease>> {
            leases::get(&mut *self.conn().await?, name).await
        }

        async fn append_tokens(
            &self,
            chunks: &[RelayChunk],
            wake: &[JobId],
            now_ms: i64,
        ) -> Result<()> {
            let mut tx = self.begin().await?;
            tokens::insert(&mut tx, chunks, now_ms).await?;
            tokens::notify(&mut tx, chunks, wake).await?;
            tx.commit().await?;
            Ok(())
        }

        async fn tokens_after(
            &self,
            job: JobId,
            after: Option<(u32, u32)>,
            limit: u32,
        ) -> Result<Vec<RelayChunk>> {
            tokens::after(&mut *self.conn().await?, job, after, limit).await
        }

        async fn rewind_tokens(&self, job: JobId, attempt: u32, keep: u32) -> Result<u64> {
            tokens::rewind(&mut *self.conn().await?, job, attempt, keep).await
        }

        async fn purge_tokens(&self, ended_before_ms: i64) -> Result<u64> {
            tokens::purge(&mut *self.conn().await?, ended_before_ms).await
        }
    };
}
pub(super) use store_methods;

/// The [`super::StoreTx`] methods.
macro_rules! tx_methods {
    () => {
        async fn commit(self) -> Result<()> {
            Ok(self.tx.commit().await?)
        }

        async fn account(&mut self, id: &str) -> Result<Option<Account>> {
            ledger::account(conn(self), id).await
        }

        async fn transfer(&mut self, id: &str) -> Result<Option<Transfer>> {
            ledger::transfer(conn(self), id).await
        }

        async fn hold_deadline(&mut self, transfer_id: &str) -> Result<Option<i64>> {
            ledger::hold_deadline(conn(self), transfer_id).await
        }

        async fn job_terms(&mut self, job: &str) -> Result<Option<JobTerms>> {
            ledger::job_terms(conn(self), job).await
        }

        async fn get_job(&mut self, id: JobId) -> Result<Option<JobRecord>> {
            jobs::get(conn(self), id).await
        }

        async fn segments(&mut self, job: JobId) -> Result<Vec<Segment>> {
            jobs::segments(conn(self), job).await
        }

        async fn audit_state(&mut self, job: &str) -> Result<Option<String>> {
            audits::state(conn(self), job).await
        }

        async fn operator_of(&mut self, node_id: &str) -> Result<Option<String>> {
            ledger::operator_of(conn(self), node_id).await
        }

        async fn add_debit(&mut self, account: &str, amount: i64, pending: bool) -> Result<bool> {
            ledger::add_debit(conn(self), account, amount, pending).await
        }

        async fn add_credit(&mut self, account: &str, amount: i64, pending: bool) -> Result<bool> {
            ledger::add_credit(conn(self), account, amount, pending).await
        }

        async fn resolve_pending(
            &mut self,
            account: &str,
            side: Side,
            pending: i64,
            posted: i64,
        ) -> Result<bool> {
            ledger::resolve_pending(conn(self), account, side, pending, posted).await
        }

        async fn insert_transfers(&mut self, transfers: &[Transfer]) -> Result<()> {
            ledger::insert_transfers(conn(self), transfers).await
        }

        async fn open_holds(&mut self, holds: &[OpenHold]) -> Result<()> {
            ledger::open_holds(conn(self), holds).await
        }

        async fn close_hold(&mut self, transfer_id: &str) -> Result<()> {
            ledger::close_hold(conn(self), transfer_id).await
        }

        async fn used_job_ids(&mut self, ids: &[String]) -> Result<HashSet<String>> {
            ledger::used_job_ids(conn(self), ids).await
        }

        async fn payers(&mut self, accounts: &[&str]) -> Result<HashMap<String, PayerBalance>> {
            ledger::payers(conn(self), accounts).await
        }

        async fn insert_terms(&mut self, terms: &[(&str, &JobTerms)]) -> Result<()> {
            ledger::insert_terms(conn(self), terms).await
        }

        async fn insert_jobs(&mut self, jobs: &[(&NewJob, i64)]) -> Result<()> {
            jobs::insert(conn(self), jobs).await
        }

        async fn insert_account_if_absent(&mut self, account: &Account) -> Result<()> {
            ledger::insert_account(conn(self), account, true).await
        }

        async fn link_operator(&mut self, node_id: &str, account: &str, now_ms: i64) -> Result<()> {
            ledger::link_operator(conn(self), node_id, account, now_ms).await
        }

        async fn epoch_paid(&mut self, epoch: i64) -> Result<bool> {
            ledger::epoch_paid(conn(self), epoch).await
        }

        async fn availability(&mut self, epoch: i64) -> Result<Vec<Availability>> {
            ledger::availability(conn(self), epoch).await
        }

        async fn mark_epoch_paid(&mut self, epoch: i64, paid_ms: i64, total: i64) -> Result<()> {
            ledger::mark_epoch_paid(conn(self), epoch, paid_ms, total).await
        }

        async fn end_audit(
            &mut self,
            job: &str,
            passed: bool,
            auditor: &str,
            verdict: &[u8],
            now_ms: i64,
        ) -> Result<Option<String>> {
            audits::end(conn(self), job, passed, auditor, verdict, now_ms).await
        }

        async fn count_record(&mut self, node: &str, delta: &RecordDelta) -> Result<()> {
            audits::count(conn(self), node, delta).await
        }

        async fn audit_record(&mut self, node: &str) -> Result<AuditRecord> {
            audits::record(conn(self), node).await
        }

        async fn ban_node(&mut self, node: &str, now_ms: i64) -> Result<()> {
            audits::ban(conn(self), node, now_ms).await
        }

        async fn fence(&mut self, lease: &Lease, now_ms: i64) -> Result<()> {
            leases::fence(conn(self), lease, now_ms).await
        }
    };
}
pub(super) use tx_methods;

/// The leases' queries ([`super::Store::acquire_lease`], `release_lease`,
/// `lease`, [`super::StoreTx::fence`]), written once: expanded in each
/// backend's `leases` module with its connection type and the row lock its
/// fence takes (`$N` placeholders, which both SQLite and PostgreSQL read).
macro_rules! lease_queries {
    ($conn:ty, $lock:literal) => {
        type Row = (String, String, i64, i64);

        fn lease((name, holder, epoch, expires_at_ms): Row) -> Lease {
            Lease {
                name,
                holder,
                epoch,
                expires_at_ms,
            }
        }

        pub(super) async fn acquire(
            conn: &mut $conn,
            name: &str,
            holder: &str,
            ttl_ms: i64,
            now: i64,
        ) -> Result<Option<Lease>> {
            let row: Option<Row> = sqlx::query_as(
                "INSERT INTO leases (name, holder, epoch, expires_at_ms) VALUES ($1, $2, 1, $3) \
                 ON CONFLICT (name) DO UPDATE SET \
                   epoch = CASE WHEN leases.holder = excluded.holder THEN leases.epoch \
                                ELSE leases.epoch + 1 END, \
                   holder = excluded.holder, expires_at_ms = excluded.expires_at_ms \
                 WHERE leases.holder = excluded.holder OR leases.expires_at_ms <= $4 \
                 RETURNING name, holder, epoch, expires_at_ms",
            )
            .bind(name)
            .bind(holder)
            .bind(now.saturating_add(ttl_ms.max(0)))
            .bind(now)
            .fetch_optional(&mut *conn)
            .await?;
            Ok(row.map(lease))
        }

        pub(super) async fn release(conn: &mut $conn, held: &Lease) -> Result<bool> {
            let done = sqlx::query(
                "UPDATE leases SET holder = '', expires_at_ms = 0 \
                 WHERE name = $1 AND holder = $2 AND epoch = $3",
            )
            .bind(&held.name)
            .bind(&held.holder)
            .bind(held.epoch)
            .execute(&mut *conn)
            .await?;
            Ok(done.rows_affected() == 1)
        }

        /// Whether the replica named by `{t}.replica` is dead (see
        /// `Store::requeue_orphans`): binds `$1` = this replica (or NULL),
        /// `$2` = now, `$3` = the liveness prefix.
        fn dead(t: &str) -> String {
            format!(
                "({t}.replica IS NULL OR {t}.replica = $1 OR NOT EXISTS (\
                   SELECT 1 FROM leases l WHERE l.name = $3 || {t}.replica \
                   AND l.holder = {t}.replica AND l.expires_at_ms > $2))"
            )
        }

        /// The orphan sweep (see `Store::requeue_orphans`), on the caller's
        /// transaction: the jobs first (their ids returned), then their
        /// open attempt rows, then the dead replicas' nodes.
        pub(super) async fn requeue_orphans(
            conn: &mut $conn,
            max_attempts: u32,
            me: Option<&str>,
            now: i64,
        ) -> Result<u64> {
            let requeued: Vec<String> = sqlx::query_scalar(&format!(
                "UPDATE jobs SET \
                   state = CASE WHEN attempt < $4 THEN 'queued' ELSE 'failed' END, \
                   attempt = CASE WHEN attempt < $4 THEN attempt + 1 ELSE attempt END, \
                   node_id = CASE WHEN attempt < $4 THEN NULL ELSE node_id END, \
                   replica = NULL, \
                   error = 'coordinator restarted while the job ran', updated_at_ms = $2 \
                 WHERE state IN ('assigned', 'running') AND {} RETURNING id",
                dead("jobs")
            ))
            .bind(me)
            .bind(now)
            .bind(crate::domain::LIVENESS_PREFIX)
            .bind(i64::from(max_attempts))
            .fetch_all(&mut *conn)
            .await?;
            for id in &requeued {
                sqlx::query(
                    "UPDATE job_attempts SET outcome = 'failed', \
                       error = 'coordinator restarted', ended_at_ms = $1 \
                     WHERE job_id = $2 AND outcome IN ('assigned', 'running')",
                )
                .bind(now)
                .bind(id)
                .execute(&mut *conn)
                .await?;
            }
            sqlx::query(&format!(
                "UPDATE nodes SET status = 'offline' WHERE status = 'online' AND {}",
                dead("nodes")
            ))
            .bind(me)
            .bind(now)
            .bind(crate::domain::LIVENESS_PREFIX)
            .execute(&mut *conn)
            .await?;
            Ok(requeued.len() as u64)
        }

        pub(super) async fn get(conn: &mut $conn, name: &str) -> Result<Option<Lease>> {
            let row: Option<Row> = sqlx::query_as(
                "SELECT name, holder, epoch, expires_at_ms FROM leases WHERE name = $1",
            )
            .bind(name)
            .fetch_optional(&mut *conn)
            .await?;
            Ok(row.map(lease))
        }

        pub(super) async fn fence(conn: &mut $conn, held: &Lease, now: i64) -> Result<()> {
            let live: Option<i64> = sqlx::query_scalar(concat!(
                "SELECT epoch FROM leases \
                     WHERE name = $1 AND holder = $2 AND epoch = $3 AND expires_at_ms > $4",
                $lock
            ))
            .bind(&held.name)
            .bind(&held.holder)
            .bind(held.epoch)
            .bind(now)
            .fetch_optional(&mut *conn)
            .await?;
            match live {
                Some(_) => Ok(()),
                None => Err(StoreError::Fenced {
                    name: held.name.clone(),
                    epoch: held.epoch,
                }),
            }
        }
    };
}
pub(super) use lease_queries;

/// The token relay's queries ([`super::Store::append_tokens`],
/// `tokens_after`, `rewind_tokens`, `purge_tokens`), written once: expanded
/// in each backend's `tokens` module with its connection and database
/// types. A chunk is stored as its protobuf encoding.
macro_rules! token_queries {
    ($conn:ty, $db:ty) => {
        use mlxnet_proto::ids::JobId;
        use prost::Message;

        use crate::domain::RelayChunk;

        /// Rows per INSERT statement (well under both backends' bound
        /// variable limits at 5 per row).
        const ROWS_PER_STATEMENT: usize = 500;

        pub(super) async fn insert(
            conn: &mut $conn,
            chunks: &[RelayChunk],
            now_ms: i64,
        ) -> Result<()> {
            for part in chunks.chunks(ROWS_PER_STATEMENT) {
                let mut q = sqlx::QueryBuilder::<$db>::new(
                    "INSERT INTO job_tokens (job_id, attempt, first_index, chunk, written_at_ms) ",
                );
                q.push_values(part, |mut row, c| {
                    row.push_bind(c.job.to_string())
                        .push_bind(i64::from(c.attempt))
                        .push_bind(i64::from(c.chunk.index))
                        .push_bind(c.chunk.encode_to_vec())
                        .push_bind(now_ms);
                });
                q.push(" ON CONFLICT (job_id, attempt, first_index) DO NOTHING");
                q.build().execute(&mut *conn).await?;
            }
            Ok(())
        }

        pub(super) async fn after(
            conn: &mut $conn,
            job: JobId,
            after: Option<(u32, u32)>,
            limit: u32,
        ) -> Result<Vec<RelayChunk>> {
            let (attempt, index) = after.map_or((-1, -1), |(a, i)| (i64::from(a), i64::from(i)));
            let rows: Vec<(i64, Vec<u8>)> = sqlx::query_as(
                "SELECT attempt, chunk FROM job_tokens \
                 WHERE job_id = $1 AND (attempt > $2 OR (attempt = $2 AND first_index > $3)) \
                 ORDER BY attempt, first_index LIMIT $4",
            )
            .bind(job.to_string())
            .bind(attempt)
            .bind(index)
            .bind(i64::from(limit))
            .fetch_all(&mut *conn)
            .await?;
            rows.into_iter()
                .map(|(attempt, bytes)| {
                    let corrupt = |what: String| StoreError::Corrupt {
                        id: job.to_string(),
                        what,
                    };
                    Ok(RelayChunk {
                        job,
                        attempt: u32::try_from(attempt)
                            .map_err(|_| corrupt(format!("token chunk attempt {attempt}")))?,
                        chunk: mlxnet_proto::v1::job_event::Tokens::decode(bytes.as_slice())
                            .map_err(|e| corrupt(format!("token chunk: {e}")))?,
                    })
                })
                .collect()
        }

        pub(super) async fn rewind(
            conn: &mut $conn,
            job: JobId,
            attempt: u32,
            keep: u32,
        ) -> Result<u64> {
            let done = sqlx::query(
                "DELETE FROM job_tokens WHERE job_id = $1 AND attempt < $2 AND first_index >= $3",
            )
            .bind(job.to_string())
            .bind(i64::from(attempt))
            .bind(i64::from(keep))
            .execute(&mut *conn)
            .await?;
            Ok(done.rows_affected())
        }

        pub(super) async fn purge(conn: &mut $conn, ended_before_ms: i64) -> Result<u64> {
            let done = sqlx::query(
                "DELETE FROM job_tokens WHERE job_id IN (SELECT id FROM jobs \
                   WHERE state IN ('completed', 'failed', 'cancelled') AND updated_at_ms < $1)",
            )
            .bind(ended_before_ms)
            .execute(&mut *conn)
            .await?;
            Ok(done.rows_affected())
        }
    };
}
pub(super) use token_queries;
