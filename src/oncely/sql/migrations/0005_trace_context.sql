-- The W3C trace context of the delivery that wrote an outbox row, so the
-- relay's send continues the trace that began at the POST.
ALTER TABLE outbox ADD COLUMN trace_context text;
