-- How the device's agent has run on its firmware (Heartbeat.health): the firmware counted, the
-- seconds run and the unexpected restarts there (the fleet's healthy hours per release).
ALTER TABLE devices ADD COLUMN health_firmware TEXT;
ALTER TABLE devices ADD COLUMN health_s DOUBLE PRECISION;
ALTER TABLE devices ADD COLUMN health_restarts BIGINT;
