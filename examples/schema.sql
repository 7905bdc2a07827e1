-- Tables the example handlers write to: `psql "$DSN" -f examples/schema.sql`.
CREATE TABLE IF NOT EXISTS example_calls (
    id          bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    entity      text        NOT NULL,
    message_id  text        NOT NULL,
    pid         integer     NOT NULL,
    started_at  timestamptz NOT NULL,
    ended_at    timestamptz NOT NULL
);
CREATE TABLE IF NOT EXISTS example_balances (
    account_id  bigint PRIMARY KEY,
    balance     bigint NOT NULL DEFAULT 0
);
