//! The relay on PostgreSQL (`--database-url postgres://…`): a real PostgreSQL server the test starts itself; what
//! one relay process writes, the next one (a restart, or another replica on the same database) reads.

mod common;

use common::TestRelay;
use http::StatusCode;
use tether_relay::Config;
use tether_testkit::postgres::Postgres;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_on_postgres_keeps_clusters_across_processes() -> anyhow::Result<()> {
    let Some(pg) = Postgres::start_or_skip("the relay on PostgreSQL")? else {
        return Ok(());
    };
    let url = pg.fresh_database()?;
    let dir = tempfile::tempdir()?;
    let config = |sub: &str| {
        let mut c = Config::new(dir.path().join(sub));
        c.database_url = Some(url.clone());
        c
    };

    let first = TestRelay::start_with(config("a")).await?;
    let admin = first.admin()?;
    let edge = admin.onboarded("edge").await?;
    anyhow::ensure!(edge.cluster == "edge");
    admin.create_ok("core").await?;
    // Nothing of the relay's state lives in its data dir's database: the SQLite file is never created.
    anyhow::ensure!(!dir.path().join("a").join("relay.db").exists());
    first.stop().await?;

    // A second relay process (another data dir, same database) sees both clusters and their facts.
    let second = TestRelay::start_with(config("b")).await?;
    let admin = second.admin()?;
    let names = admin.list_names("").await?;
    anyhow::ensure!(
        names.contains(&"edge".to_owned()) && names.contains(&"core".to_owned()),
        "{names:?}"
    );
    // A name is still unique across processes sharing the store.
    let again = admin.create("edge").await?;
    anyhow::ensure!(again.status == StatusCode::CONFLICT, "{again:?}");
    second.stop().await?;
    pg.stop();
    Ok(())
}
