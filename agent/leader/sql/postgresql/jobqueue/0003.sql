-- A demand posted for the queue's holder is claimed by it: `unread` cleared under FOR UPDATE SKIP
-- LOCKED, in a transaction fenced by the queue's epoch. A revision read as "newer than the last
-- one read" could skip for good a posting transaction that committed after a newer one was read.
ALTER TABLE job_demands ADD COLUMN unread BOOLEAN NOT NULL DEFAULT true;
CREATE INDEX job_demands_unread ON job_demands(worker) WHERE unread;
DROP INDEX job_demands_by_rev;
ALTER TABLE job_demands DROP COLUMN rev;
DROP SEQUENCE job_demands_rev;
