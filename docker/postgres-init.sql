-- postgres-init.sql: the second database of docker/compose.yaml's PostgreSQL, MLflow's.
-- The image runs it once, as POSTGRES_USER, when the data directory is empty; Prefect's
-- database is POSTGRES_DB. Never holds a credential.
CREATE DATABASE mlflow;
