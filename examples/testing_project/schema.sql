-- The service's tables; the testing kit applies this file to every test's database.
CREATE TABLE balances (
    account_id bigint PRIMARY KEY,
    balance    bigint NOT NULL
);
CREATE TABLE ledger (
    payment_id text   NOT NULL,   -- no unique key: a payment applied twice shows here
    account_id bigint NOT NULL,
    amount     bigint NOT NULL
);
CREATE TABLE receipts (
    payment_id text NOT NULL
);
