//! Money: accounts with their balances, transfers (the TigerBeetle model:
//! posted, or two-phase pending then post / void / expire), a model's
//! price and a job's payment terms. Amounts are integer micro-MLX
//! (1 MLX = 1,000,000 micro-MLX), never floats.

/// Who an account belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AccountKind {
    Client,
    Operator,
    Fee,
    RewardPool,
    Escrow,
    Treasury,
}

impl AccountKind {
    pub fn as_str(self) -> &'static str {
        match self {
            AccountKind::Client => "client",
            AccountKind::Operator => "operator",
            AccountKind::Fee => "fee",
            AccountKind::RewardPool => "reward_pool",
            AccountKind::Escrow => "escrow",
            AccountKind::Treasury => "treasury",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "client" => AccountKind::Client,
            "operator" => AccountKind::Operator,
            "fee" => AccountKind::Fee,
            "reward_pool" => AccountKind::RewardPool,
            "escrow" => AccountKind::Escrow,
            "treasury" => AccountKind::Treasury,
            _ => return None,
        })
    }
}

/// An account with its balances.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Account {
    pub id: String,
    pub name: String,
    pub kind: AccountKind,
    pub no_overdraft: bool,
    pub debits_pending: i64,
    pub debits_posted: i64,
    pub credits_pending: i64,
    pub credits_posted: i64,
    pub created_at_ms: i64,
}

impl Account {
    /// A new account with zero balances.
    pub fn new(id: String, name: String, kind: AccountKind, created_at_ms: i64) -> Self {
        Account {
            id,
            name,
            kind,
            no_overdraft: true,
            debits_pending: 0,
            debits_posted: 0,
            credits_pending: 0,
            credits_posted: 0,
            created_at_ms,
        }
    }

    /// Posted balance.
    pub fn balance(&self) -> i64 {
        self.credits_posted - self.debits_posted
    }

    /// What can still be spent or held: the balance less open holds.
    pub fn available(&self) -> i64 {
        self.balance() - self.debits_pending
    }
}

/// What kind of movement a transfer is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TransferKind {
    /// Moves the amount at once.
    Posted,
    /// Reserves the amount (a hold) until posted, voided or expired.
    Pending,
    /// Posts part or all of a pending transfer; the rest is released.
    PostPending,
    /// Releases a pending transfer.
    VoidPending,
    /// Releases a pending transfer whose deadline passed.
    ExpirePending,
}

impl TransferKind {
    pub fn as_str(self) -> &'static str {
        match self {
            TransferKind::Posted => "posted",
            TransferKind::Pending => "pending",
            TransferKind::PostPending => "post_pending",
            TransferKind::VoidPending => "void_pending",
            TransferKind::ExpirePending => "expire_pending",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "posted" => TransferKind::Posted,
            "pending" => TransferKind::Pending,
            "post_pending" => TransferKind::PostPending,
            "void_pending" => TransferKind::VoidPending,
            "expire_pending" => TransferKind::ExpirePending,
            _ => return None,
        })
    }

    /// Post, void or expire: refers to a pending transfer.
    pub fn resolves(self) -> bool {
        matches!(
            self,
            TransferKind::PostPending | TransferKind::VoidPending | TransferKind::ExpirePending
        )
    }
}

/// A transfer as recorded.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Transfer {
    pub id: String,
    pub kind: TransferKind,
    pub debit: String,
    pub credit: String,
    pub amount: i64,
    pub pending_id: Option<String>,
    pub deadline_ms: Option<i64>,
    pub job_id: Option<String>,
    pub node_id: Option<String>,
    /// Model tokens a payout pays for.
    pub tokens: i64,
    pub memo: String,
    pub created_at_ms: i64,
}

/// A transfer to make. For a resolution (post, void, expire) `debit` and
/// `credit` are taken from the pending transfer and may be left empty;
/// `amount` is the amount to post (ignored by void and expire).
#[derive(Clone, Debug, Default)]
pub struct NewTransfer {
    pub id: String,
    pub kind: Option<TransferKind>,
    pub debit: String,
    pub credit: String,
    pub amount: i64,
    pub pending_id: Option<String>,
    pub deadline_ms: Option<i64>,
    pub job_id: Option<String>,
    pub node_id: Option<String>,
    pub tokens: i64,
    pub memo: String,
}

/// What applying a transfer did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Applied {
    Created,
    /// A transfer with this id and the same fields was already recorded.
    AlreadyExists,
}

/// A model's price, in micro-MLX per million tokens.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Price {
    pub input_per_mtok: u64,
    pub output_per_mtok: u64,
}

impl Price {
    /// The price of `input` prompt tokens and `output` generated tokens,
    /// rounded up to a whole micro-MLX.
    pub fn of(&self, input: u64, output: u64) -> i64 {
        let total = u128::from(input) * u128::from(self.input_per_mtok)
            + u128::from(output) * u128::from(self.output_per_mtok);
        let micro = total.div_ceil(1_000_000);
        i64::try_from(micro).unwrap_or(i64::MAX)
    }
}

/// Who pays for a job, and at what price.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct JobTerms {
    pub account: String,
    pub price: Price,
    pub max_price: i64,
}

/// The id of job `job`'s hold (its pending transfer).
pub fn hold_id(job: &str) -> String {
    format!("job:{job}:hold")
}

/// Sums over every account.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Totals {
    /// Sum of posted `credits - debits`: always 0.
    pub posted: i64,
    /// Sum of pending `credits - debits`: always 0.
    pub pending: i64,
    /// Open holds.
    pub open_holds: i64,
}

/// One node's earnings over a period.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NodeEarnings {
    pub node_id: String,
    pub micro_mlx: i64,
    pub jobs: i64,
    pub tokens: i64,
}
