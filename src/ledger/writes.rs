//! Writes sent together: statements whose results nothing reads (an
//! insert, an update without `RETURNING`), held back and then sent as one
//! statement, each a data-modifying common table expression of it. A phase
//! sends what it holds before its next statement of any other kind and
//! before its commit (with its opening statement, when that is held too:
//! [`Writes::send_with`]), so every statement sees the writes held before
//! it; only the round trips are fewer. Within one batch there is no order:
//! PostgreSQL runs the writes in an order of its own (in practice the last
//! first), and they do not see each other's rows (they share a snapshot).
//! So a batch never holds a write that needs another of its writes done
//! first, never two writes of one row, and nothing may read meaning into
//! the order of the ids its inserts draw. A write that must change one row
//! ([`Writes::push_one`]) is counted in the same statement, and the batch
//! fails if it changed none: nothing is read back, and nothing is missed.

use sqlx::postgres::{PgArguments, PgRow};
use sqlx::{Arguments, Encode, PgConnection, Postgres, Row, Type};

use super::LedgerError;

/// Writes waiting to be sent, with their arguments bound in order.
#[derive(Default, Clone)]
pub struct Writes {
    /// Each statement, its placeholders numbered after those before it.
    statements: Vec<String>,
    args: PgArguments,
    /// Why a write could not be held (a value that did not encode, or
    /// arguments that do not match its placeholders), reported by `send`.
    broken: Option<String>,
    /// The writes that must change exactly one row, by index, each with
    /// what it means if one does not.
    checked: Vec<(usize, String)>,
}

/// The arguments of one held write, bound in the order of its placeholders.
pub struct Binds<'a> {
    args: &'a mut PgArguments,
    broken: &'a mut Option<String>,
}

impl Binds<'_> {
    pub fn bind<'q, T: Encode<'q, Postgres> + Type<Postgres>>(&mut self, value: T) -> &mut Self {
        if let Err(e) = self.args.add(value)
            && self.broken.is_none()
        {
            *self.broken = Some(e.to_string());
        }
        self
    }
}

impl Writes {
    pub fn is_empty(&self) -> bool {
        self.statements.is_empty() && self.broken.is_none()
    }

    /// Holds `sql` (placeholders `$1`..`$n`), its arguments bound by `bind`.
    pub fn push(&mut self, sql: &str, bind: impl FnOnce(&mut Binds<'_>)) {
        let first = self.args.len();
        let (statement, placeholders) = renumber(sql, first);
        bind(&mut Binds { args: &mut self.args, broken: &mut self.broken });
        let bound = self.args.len() - first;
        if bound != placeholders && self.broken.is_none() {
            self.broken = Some(format!("{bound} argument(s) bound for {placeholders} placeholder(s) in: {sql}"));
        }
        self.statements.push(statement);
    }

    /// Holds `sql`, an `UPDATE` that must change exactly one row: the batch
    /// it goes in fails as `LedgerError::Corrupt(missing)` if it does not.
    /// `sql` ends with its `WHERE` clause (`RETURNING 1` is added to it).
    pub fn push_one(&mut self, sql: &str, missing: String, bind: impl FnOnce(&mut Binds<'_>)) {
        self.checked.push((self.statements.len(), missing));
        self.push(&format!("{sql}\n         RETURNING 1"), bind);
    }

    /// Whether each checked write changed one row, as an SQL array.
    fn checks(&self) -> String {
        let each: Vec<String> = self.checked.iter().map(|(i, _)| format!("(SELECT count(*) FROM w{i}) = 1")).collect();
        format!("ARRAY[{}]::bool[]", each.join(", "))
    }

    /// An error naming the first checked write that changed no row, if any.
    fn verify(checked: &[(usize, String)], changed: &[bool]) -> Result<(), LedgerError> {
        match checked.iter().zip(changed).find(|(_, one)| !**one) {
            Some(((_, missing), _)) => Err(LedgerError::Corrupt(missing.clone())),
            None => Ok(()),
        }
    }

    /// Sends what is held, as one statement, and holds nothing after.
    pub async fn send(&mut self, conn: &mut PgConnection) -> Result<(), LedgerError> {
        let checks = self.checks();
        let Writes { statements, args, broken, checked } = std::mem::take(self);
        if let Some(why) = broken {
            return Err(LedgerError::Database(sqlx::Error::Encode(format!("a held write: {why}").into())));
        }
        match statements.as_slice() {
            [] => Ok(()),
            [one] if checked.is_empty() => {
                sqlx::query_with(sqlx::AssertSqlSafe(one.as_str()), args).execute(conn).await?;
                Ok(())
            }
            many => {
                let sql = format!("WITH {} SELECT {checks}", named(many).join(", "));
                let changed: Vec<bool> =
                    sqlx::query_scalar_with(sqlx::AssertSqlSafe(sql), args).fetch_one(conn).await?;
                Self::verify(&checked, &changed)
            }
        }
    }

    /// Sends what is held with a statement of the caller's, as one: its
    /// common table expressions `ctes` (placeholders from `$1`, bound by
    /// `bind`), then `query`, which reads them. The held writes go as more
    /// expressions of the same statement, so what holds for a batch holds
    /// for them and `ctes` alike: no order, one snapshot, no row written
    /// twice. Returns the first column of the row `query` returns, if it
    /// returns one; with one, every checked write must have changed its row.
    pub async fn send_with(
        self,
        conn: &mut PgConnection,
        ctes: &str,
        query: &str,
        bind: impl FnOnce(&mut Binds<'_>),
    ) -> Result<Option<i64>, LedgerError> {
        let checks = self.checks();
        let Writes { statements, mut args, mut broken, checked } = self;
        let first = args.len();
        let (ctes, placeholders) = renumber(ctes, first);
        bind(&mut Binds { args: &mut args, broken: &mut broken });
        let bound = args.len() - first;
        if bound != placeholders && broken.is_none() {
            broken = Some(format!("{bound} argument(s) bound for {placeholders} placeholder(s) with the held writes"));
        }
        if let Some(why) = broken {
            return Err(LedgerError::Database(sqlx::Error::Encode(format!("a held write: {why}").into())));
        }
        let held: String = named(&statements).iter().map(|w| format!("{w}, ")).collect();
        let sql = format!("WITH {held}{ctes},\n     answered AS ({query})\n     SELECT a.*, {checks} FROM answered a");
        let answered = sqlx::query_with(sqlx::AssertSqlSafe(sql), args)
            .try_map(|row: PgRow| Ok((row.try_get(0)?, row.try_get::<Vec<bool>, _>(row.len() - 1)?)))
            .fetch_optional(conn)
            .await?;
        match answered {
            Some((first, changed)) => Self::verify(&checked, &changed).map(|()| Some(first)),
            None => Ok(None),
        }
    }
}

/// The held statements as common table expressions, `w0`, `w1`, ... in
/// order (the names [`Writes::checks`] counts).
fn named(statements: &[String]) -> Vec<String> {
    statements.iter().enumerate().map(|(i, s)| format!("w{i} AS ({s})")).collect()
}

/// `sql` with each placeholder `$n` made `$(n + offset)`, and the highest
/// `n` it holds.
fn renumber(sql: &str, offset: usize) -> (String, usize) {
    let mut out = String::with_capacity(sql.len() + 8);
    let mut highest = 0;
    let mut rest = sql;
    while let Some(at) = rest.find('$') {
        out.push_str(&rest[..=at]);
        rest = &rest[at + 1..];
        let digits = rest.bytes().take_while(u8::is_ascii_digit).count();
        if let Ok(n) = rest[..digits].parse::<usize>() {
            highest = highest.max(n);
            out.push_str(&(n + offset).to_string());
        }
        rest = &rest[digits..];
    }
    out.push_str(rest);
    (out, highest)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn placeholders_are_numbered_after_the_writes_before() {
        assert_eq!(renumber("VALUES ($1, $2, $10)", 3), ("VALUES ($4, $5, $13)".to_owned(), 10));
        assert_eq!(renumber("SELECT '$' || $1", 0), ("SELECT '$' || $1".to_owned(), 1));
        assert_eq!(renumber("now()", 7), ("now()".to_owned(), 0));
    }

    #[test]
    fn a_write_bound_short_of_its_placeholders_is_held_as_broken() {
        let mut writes = Writes::default();
        writes.push("INSERT INTO t VALUES ($1, $2)", |b| {
            b.bind(1_i64);
        });
        assert!(writes.broken.as_deref().is_some_and(|why| why.contains("1 argument(s) bound for 2")));
    }
}
