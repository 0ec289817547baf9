-- unregister_layer: the events of a layer are the only copy of its changes, so it refuses (55006)
-- while any wait unpublished, also inside the transaction that wrote them; it refuses the built-in
-- layer (0A000), an unknown name (42704) and a role that does not own the table (42501), and a
-- refusal changes nothing. Once it goes through, the layer's state goes with it, its old outbox
-- rows stay, and a name registered again gets a higher registration_id.
CREATE TABLE public.brief (id bigint PRIMARY KEY, geom geometry(Point, 4326), version integer NOT NULL DEFAULT 0);
SELECT feature_outbox.register_layer('brief', 'public.brief');
SELECT registration_id AS first_registration FROM feature_outbox.layers WHERE layer = 'brief' \gset
CREATE FUNCTION layer_rows(l text) RETURNS text LANGUAGE sql AS $$
    SELECT format('registered=%s state=%s outbox=%s unpublished=%s',
                  (SELECT count(*) FROM feature_outbox.layer_registry r WHERE r.layer = l),
                  (SELECT count(*) FROM feature_outbox.feature_state s WHERE s.layer = l),
                  (SELECT count(*) FROM feature_outbox.outbox o WHERE o.layer = l),
                  (SELECT count(*) FROM feature_outbox.outbox o WHERE o.layer = l AND o.published_at IS NULL))
$$;

-- Inside the writing transaction its row is unpublished already.
BEGIN;
SELECT feature_outbox.edit_feature('brief', 1, '{"type":"Point","coordinates":[1,1]}', 'created');
SELECT try($$SELECT feature_outbox.unregister_layer('brief')$$);
COMMIT;
SELECT feature_outbox.edit_feature('brief', 2, '{"type":"Point","coordinates":[2,2]}', 'created');
SELECT layer_rows('brief');
SELECT try($$SELECT feature_outbox.unregister_layer('brief')$$);
SELECT layer_rows('brief');

-- A parked row waits for a person, not for the relay: it does not hold the layer.
UPDATE feature_outbox.outbox SET parked_at = now() WHERE layer = 'brief' AND feature_id = 1;
SELECT try($$SELECT feature_outbox.unregister_layer('brief')$$);

-- Not the built-in layer, not an unknown one (the hint lists the registered layers), not NULL.
SELECT try($$SELECT feature_outbox.unregister_layer('features')$$);
SELECT try($$SELECT feature_outbox.unregister_layer('nosuch')$$);
SELECT try($$SELECT feature_outbox.unregister_layer(NULL)$$);

-- Not a role that does not own the table, even with EXECUTE (and nothing is granted to PUBLIC).
CREATE ROLE regress_unreg_stranger;
SELECT has_function_privilege('regress_unreg_stranger', 'feature_outbox.unregister_layer(text)', 'EXECUTE') AS public_execute;
SET ROLE regress_unreg_stranger;
SELECT try($$SELECT feature_outbox.unregister_layer('brief')$$);
RESET ROLE;
GRANT EXECUTE ON FUNCTION feature_outbox.unregister_layer(text) TO regress_unreg_stranger;
SET ROLE regress_unreg_stranger;
SELECT try($$SELECT feature_outbox.unregister_layer('brief')$$);
RESET ROLE;
SELECT layer_rows('brief');

-- Published (as the relay would mark them), the layer may go; its state goes with it.
UPDATE feature_outbox.outbox SET published_at = now() WHERE layer = 'brief' AND feature_id = 2;
SELECT feature_outbox.unregister_layer('brief');
SELECT layer_rows('brief');
SELECT try($$SELECT feature_outbox.edit_feature('brief', 3, '{"type":"Point","coordinates":[1,1]}', 'created')$$);
SELECT try($$SELECT feature_outbox.record_edit('brief', 2, 'updated')$$);
SELECT try($$SELECT feature_outbox.unregister_layer('brief')$$);
SELECT count(*) AS rows_of_the_table_untouched FROM public.brief;

-- Registered again, the name starts over: a higher registration_id and no state; the table's rows
-- are still there (created is refused), and the first edit takes its previous key from the row.
SELECT feature_outbox.register_layer('brief', 'public.brief');
SELECT registration_id > :first_registration AS registration_id_is_higher FROM feature_outbox.layers WHERE layer = 'brief';
SELECT try($$SELECT feature_outbox.edit_feature('brief', 2, '{"type":"Point","coordinates":[3,3]}', 'created')$$);
SELECT feature_outbox.edit_feature('brief', 2, '{"type":"Point","coordinates":[3,3]}', 'moved');
SELECT feature_version, event_type, previous_routing_key IS NULL AS no_previous_key
  FROM feature_outbox.outbox WHERE layer = 'brief' ORDER BY id;

DROP OWNED BY regress_unreg_stranger;
DROP ROLE regress_unreg_stranger;
