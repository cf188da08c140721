//! Status changes that payments and refunds (a ledger's subjects) make the
//! same way, each in its own table: marked indeterminate at every park
//! past the limit (what follows the change happens once), and marked
//! returned by the rail (with the reason code, for the entry and event
//! that go with it).

use sqlx::postgres::PgRow;
use sqlx::{FromRow, PgConnection, Row};
use uuid::Uuid;

use super::LedgerError;
use super::phase::fence_param;
use crate::domain::{ClientId, Fence};

/// One of the tables: its name, the columns the API shows, and the column
/// a return's reason code goes to.
pub(super) struct Subjects {
    pub table: &'static str,
    pub columns: &'static str,
    pub reason: &'static str,
}

impl Subjects {
    /// Marks `id` indeterminate; returns it as it now stands when it
    /// became so now, `None` when it already was.
    pub async fn mark_indeterminate<T: for<'r> FromRow<'r, PgRow>>(
        &self,
        conn: &mut PgConnection,
        id: Uuid,
        fence: Fence,
    ) -> Result<Option<T>, LedgerError> {
        let Subjects { table, columns, .. } = self;
        let query = format!(
            "WITH was AS (SELECT status AS previous FROM {table} WHERE id = $1 FOR UPDATE)
             UPDATE {table} SET status = 'indeterminate', fence = $2, updated_at = now() FROM was
              WHERE id = $1 RETURNING {columns}, was.previous"
        );
        let row = sqlx::query(sqlx::AssertSqlSafe(query))
            .bind(id)
            .bind(fence_param(fence))
            .fetch_optional(conn)
            .await?
            .ok_or_else(|| LedgerError::Corrupt(format!("{table} has no row {id}")))?;
        let previous: String = row.try_get("previous")?;
        Ok(if previous == "indeterminate" { None } else { Some(T::from_row(&row)?) })
    }

    /// Marks `id` returned by the rail, with the reason code; returns it as
    /// it now stands, whose it is, and the fence it was last written under.
    pub async fn mark_returned<T: for<'r> FromRow<'r, PgRow>>(
        &self,
        conn: &mut PgConnection,
        id: Uuid,
        reason: &str,
    ) -> Result<(T, ClientId, Fence), LedgerError> {
        let Subjects { table, columns, reason: column } = self;
        let query = format!(
            "UPDATE {table} SET status = 'returned', {column} = $2, updated_at = now()
              WHERE id = $1 RETURNING {columns}, fence, client_id"
        );
        let row = sqlx::query(sqlx::AssertSqlSafe(query))
            .bind(id)
            .bind(reason)
            .fetch_optional(&mut *conn)
            .await?
            .ok_or_else(|| LedgerError::Corrupt(format!("{table} has no row {id}")))?;
        let fence: i64 = row.try_get("fence")?;
        let client: Uuid = row.try_get("client_id")?;
        Ok((T::from_row(&row)?, ClientId::new(client), Fence::new(fence.unsigned_abs())))
    }
}
