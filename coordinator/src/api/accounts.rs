//! Accounts: balance, history, earnings, API keys, and (admin) accounts and
//! grants. Every method acts for the caller the auth layer authenticated;
//! another account's keys need the admin scope.

use std::{collections::BTreeMap, sync::Arc};

use mlxnet_proto::v1::{
    accounts_server::Accounts, ApiKeyInfo, BalanceRequest, BalanceResponse, CreateAccountRequest,
    CreateAccountResponse, CreateApiKeyRequest, CreateApiKeyResponse, EarningsPeriod,
    EarningsRequest, EarningsResponse, GrantRequest, GrantResponse, HistoryRequest,
    HistoryResponse, LedgerEntry, ListApiKeysRequest, ListApiKeysResponse, NodeEarnings,
    RevokeApiKeyRequest, RevokeApiKeyResponse,
};
use tonic::{Request, Response, Status};

use super::{auth::caller, ApiContext};
use crate::{
    api::error::ApiError,
    domain::{AccountKind, Applied, Caller, Scope, Scopes, TransferKind},
    store::Store,
    util::now_ms,
};

const HISTORY_DEFAULT: u32 = 20;
const HISTORY_MAX: u32 = 200;
const DAY_MS: i64 = 24 * 60 * 60 * 1000;

pub struct AccountsApi {
    d: Arc<ApiContext>,
}

impl AccountsApi {
    pub fn new(d: Arc<ApiContext>) -> Self {
        Self { d }
    }
}

/// The account a request names: the caller's own when empty; another
/// account only for an admin key.
fn target(caller: &Caller, named: &str) -> Result<String, ApiError> {
    if named.is_empty() || named == caller.account_id {
        Ok(caller.account_id.clone())
    } else if caller.scopes.allows(Scope::Admin) {
        Ok(named.to_owned())
    } else {
        Err(ApiError::PermissionDenied(
            "another account's keys need an admin key".into(),
        ))
    }
}

/// Start of the current UTC day and of the current week (Monday), in ms.
pub fn period_starts(now_ms: i64) -> (i64, i64) {
    let days = now_ms.div_euclid(DAY_MS);
    // 1970-01-01 was a Thursday: Monday-based weekday = (days + 3) mod 7.
    let weekday = (days + 3).rem_euclid(7);
    (days * DAY_MS, (days - weekday) * DAY_MS)
}

#[tonic::async_trait]
impl Accounts for AccountsApi {
    async fn balance(
        &self,
        req: Request<BalanceRequest>,
    ) -> Result<Response<BalanceResponse>, Status> {
        let me = caller(&req)?;
        let a = self
            .d
            .ledger
            .account(&me.account_id)
            .await
            .map_err(ApiError::from)?
            .ok_or(ApiError::Unauthenticated)?;
        Ok(Response::new(BalanceResponse {
            account: a.name.clone(),
            balance_micro_mlx: a.balance(),
            held_micro_mlx: a.debits_pending,
            account_id: a.id.clone(),
            available_micro_mlx: a.available(),
        }))
    }

    async fn history(
        &self,
        req: Request<HistoryRequest>,
    ) -> Result<Response<HistoryResponse>, Status> {
        let me = caller(&req)?;
        let limit = match req.get_ref().limit {
            0 => HISTORY_DEFAULT,
            n => n.min(HISTORY_MAX),
        };
        let rows = self
            .d
            .ledger
            .history(&me.account_id, limit)
            .await
            .map_err(ApiError::from)?;
        let mut entries = Vec::with_capacity(rows.len());
        for t in rows {
            let mine_debit = t.debit == me.account_id;
            // Effect on the available balance: a hold takes its amount at
            // once; its post gives back what was not spent; a void or expiry
            // gives it all back.
            let amount = match t.kind {
                TransferKind::Posted if mine_debit => -t.amount,
                TransferKind::Posted => t.amount,
                TransferKind::Pending if mine_debit => -t.amount,
                TransferKind::PostPending
                | TransferKind::VoidPending
                | TransferKind::ExpirePending
                    if mine_debit =>
                {
                    let held = match &t.pending_id {
                        Some(p) => self
                            .d
                            .ledger
                            .get_transfer(p)
                            .await
                            .map_err(ApiError::from)?
                            .map_or(0, |p| p.amount),
                        None => 0,
                    };
                    if t.kind == TransferKind::PostPending {
                        held - t.amount
                    } else {
                        held
                    }
                }
                TransferKind::PostPending => t.amount,
                _ => 0,
            };
            entries.push(LedgerEntry {
                transfer_id: t.id.clone(),
                kind: t.kind.as_str().into(),
                memo: t.memo.clone(),
                amount_micro_mlx: amount,
                counterparty: if mine_debit { t.credit } else { t.debit },
                job_id: t.job_id.unwrap_or_default(),
                node_id: t.node_id.unwrap_or_default(),
                tokens: t.tokens.max(0) as u64,
                created_at_ms: t.created_at_ms,
            });
        }
        Ok(Response::new(HistoryResponse { entries }))
    }

    async fn earnings(
        &self,
        req: Request<EarningsRequest>,
    ) -> Result<Response<EarningsResponse>, Status> {
        let me = caller(&req)?;
        let (today, week) = period_starts(now_ms());
        let mut nodes: BTreeMap<String, NodeEarnings> = BTreeMap::new();
        for n in self
            .d
            .ledger
            .nodes_of(&me.account_id)
            .await
            .map_err(ApiError::from)?
        {
            nodes.insert(
                n.clone(),
                NodeEarnings {
                    node_id: n,
                    ..Default::default()
                },
            );
        }
        let mut totals = [
            EarningsPeriod::default(),
            EarningsPeriod::default(),
            EarningsPeriod::default(),
        ];
        for (i, since) in [today, week, 0].into_iter().enumerate() {
            for e in self
                .d
                .ledger
                .earnings(&me.account_id, since)
                .await
                .map_err(ApiError::from)?
            {
                let period = EarningsPeriod {
                    micro_mlx: e.micro_mlx,
                    jobs: e.jobs.max(0) as u64,
                    tokens: e.tokens.max(0) as u64,
                };
                totals[i].micro_mlx += period.micro_mlx;
                totals[i].jobs += period.jobs;
                totals[i].tokens += period.tokens;
                let entry = nodes
                    .entry(e.node_id.clone())
                    .or_insert_with(|| NodeEarnings {
                        node_id: e.node_id.clone(),
                        ..Default::default()
                    });
                let slot = match i {
                    0 => &mut entry.today,
                    1 => &mut entry.week,
                    _ => &mut entry.all_time,
                };
                *slot = Some(period);
            }
        }
        for n in nodes.values_mut() {
            let r = self
                .d
                .store
                .audit_record(&n.node_id)
                .await
                .map_err(ApiError::from)?;
            n.audits_passed = r.clean;
            n.audits_failed = r.failed;
            n.banned = r.banned;
        }
        let [t, w, a] = totals;
        Ok(Response::new(EarningsResponse {
            account_id: me.account_id,
            today: Some(t),
            week: Some(w),
            all_time: Some(a),
            nodes: nodes.into_values().collect(),
            next_reward_epoch_ms: self.d.ledger.reward_epoch_end_ms(now_ms()),
        }))
    }

    async fn list_api_keys(
        &self,
        req: Request<ListApiKeysRequest>,
    ) -> Result<Response<ListApiKeysResponse>, Status> {
        let me = caller(&req)?;
        let account = target(&me, &req.get_ref().account_id)?;
        let keys = self
            .d
            .ledger
            .list_keys(&account)
            .await
            .map_err(ApiError::from)?;
        Ok(Response::new(ListApiKeysResponse {
            keys: keys
                .into_iter()
                .map(|k| ApiKeyInfo {
                    key_id: k.id,
                    scopes: k.scopes.names().into_iter().map(String::from).collect(),
                    label: k.label,
                    created_at_ms: k.created_at_ms,
                    expires_at_ms: k.expires_at_ms.unwrap_or(0),
                    revoked_at_ms: k.revoked_at_ms.unwrap_or(0),
                })
                .collect(),
        }))
    }

    async fn create_api_key(
        &self,
        req: Request<CreateApiKeyRequest>,
    ) -> Result<Response<CreateApiKeyResponse>, Status> {
        let me = caller(&req)?;
        let r = req.into_inner();
        let account = target(&me, &r.account_id)?;
        let scopes =
            Scopes::from_list(r.scopes.iter().map(String::as_str)).map_err(ApiError::from)?;
        let exceeds = (scopes.admin && !me.scopes.admin)
            || (scopes.submit && !me.scopes.allows(Scope::Submit))
            || (scopes.read && !me.scopes.allows(Scope::Read));
        if exceeds {
            return Err(ApiError::PermissionDenied(
                "a new key cannot have scopes the caller's key lacks".into(),
            )
            .into());
        }
        let expires = match r.ttl_seconds {
            0 => None,
            s => Some(
                now_ms().saturating_add(i64::try_from(s.saturating_mul(1000)).unwrap_or(i64::MAX)),
            ),
        };
        let key = self
            .d
            .ledger
            .create_child_key(&me, &account, scopes, &r.label, expires)
            .await
            .map_err(ApiError::from)?;
        Ok(Response::new(CreateApiKeyResponse {
            key_id: key.id.clone(),
            api_key: key.secret().to_owned(),
            account_id: key.account_id.clone(),
            scopes: key.scopes.names().into_iter().map(String::from).collect(),
            expires_at_ms: key.expires_at_ms.unwrap_or(0),
        }))
    }

    async fn revoke_api_key(
        &self,
        req: Request<RevokeApiKeyRequest>,
    ) -> Result<Response<RevokeApiKeyResponse>, Status> {
        let me = caller(&req)?;
        let key_id = &req.get_ref().key_id;
        let scope = (!me.scopes.allows(Scope::Admin)).then_some(me.account_id.as_str());
        if !self
            .d
            .ledger
            .revoke_key(key_id, scope)
            .await
            .map_err(ApiError::from)?
        {
            return Err(ApiError::NotFound(format!(
                "no unrevoked key {:?} on this account",
                key_id.chars().take(32).collect::<String>()
            ))
            .into());
        }
        Ok(Response::new(RevokeApiKeyResponse {}))
    }

    async fn create_account(
        &self,
        req: Request<CreateAccountRequest>,
    ) -> Result<Response<CreateAccountResponse>, Status> {
        caller(&req)?;
        let r = req.into_inner();
        let kind = match r.kind.as_str() {
            "" | "client" => AccountKind::Client,
            "operator" => AccountKind::Operator,
            other => {
                return Err(ApiError::InvalidArgument(format!(
                    "account kind {:?} is not client or operator",
                    other.chars().take(32).collect::<String>()
                ))
                .into())
            }
        };
        let a = self
            .d
            .ledger
            .create_account(&r.name, kind)
            .await
            .map_err(ApiError::from)?;
        Ok(Response::new(CreateAccountResponse {
            account_id: a.id,
            name: a.name,
            kind: a.kind.as_str().into(),
        }))
    }

    async fn grant(&self, req: Request<GrantRequest>) -> Result<Response<GrantResponse>, Status> {
        caller(&req)?;
        let r = req.into_inner();
        if r.idempotency_key.is_empty() || r.idempotency_key.len() > 128 {
            return Err(ApiError::InvalidArgument(
                "idempotency_key is required (1 to 128 bytes)".into(),
            )
            .into());
        }
        let amount = i64::try_from(r.amount_micro_mlx)
            .ok()
            .filter(|a| *a > 0)
            .ok_or_else(|| ApiError::InvalidArgument("amount_micro_mlx must be positive".into()))?;
        let memo = if r.memo.is_empty() {
            "grant".to_owned()
        } else {
            r.memo.chars().take(128).collect()
        };
        let applied = self
            .d
            .ledger
            .grant(&r.idempotency_key, &r.account_id, amount, &memo)
            .await
            .map_err(ApiError::from)?;
        let balance = self
            .d
            .ledger
            .account(&r.account_id)
            .await
            .map_err(ApiError::from)?
            .map_or(0, |a| a.balance());
        Ok(Response::new(GrantResponse {
            created: applied == Applied::Created,
            balance_micro_mlx: balance,
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn periods_start_at_utc_midnight_and_monday() {
        // 2026-11-30 is a Monday; 12:00 UTC.
        let noon = 1_795_996_800_000 + 12 * 3_600_000;
        let (day, week) = period_starts(noon);
        assert_eq!(day, 1_795_996_800_000);
        assert_eq!(week, day, "on a Monday the week starts today");
        let (day2, week2) = period_starts(noon + 3 * DAY_MS);
        assert_eq!(day2, day + 3 * DAY_MS);
        assert_eq!(week2, week);
    }
}
