async def test_servers_answer(redis, pool):
    """Both real servers answer and the schema is migrated."""
    assert await redis.ping()
    async with pool.connection() as conn:
        cur = await conn.execute("SELECT count(*) FROM jobs")
        assert (await cur.fetchone()) == (0,)
