-- Loaded (not echoed) into each regression database before its test file.
SET client_min_messages = warning;
CREATE EXTENSION feature_outbox CASCADE;
RESET client_min_messages;

-- Runs a statement and returns 'ok', or its SQLSTATE, message and hint: stable expected output.
CREATE FUNCTION try(sql text) RETURNS text LANGUAGE plpgsql AS $$
DECLARE
    state text; msg text; hint text;
BEGIN
    EXECUTE sql;
    RETURN 'ok';
EXCEPTION WHEN OTHERS THEN
    GET STACKED DIAGNOSTICS state = RETURNED_SQLSTATE, msg = MESSAGE_TEXT, hint = PG_EXCEPTION_HINT;
    RETURN state || ': ' || msg || CASE WHEN hint <> '' THEN E'\n  HINT: ' || hint ELSE '' END;
END
$$;

-- A fingerprint of everything edit_feature writes: row counts and the sum of versions.
CREATE FUNCTION written() RETURNS text LANGUAGE sql AS $$
    SELECT format('features=%s versions=%s outbox=%s state=%s',
                  (SELECT count(*) FROM feature_outbox.features),
                  (SELECT coalesce(sum(version), 0) FROM feature_outbox.features),
                  (SELECT count(*) FROM feature_outbox.outbox),
                  (SELECT count(*) FROM feature_outbox.feature_state))
$$;

-- The H3 cell of an EPSG:4326 point at the current feature_outbox.h3_resolution, straight from h3o:
-- what a routing key must equal when the routing point is known.
CREATE FUNCTION cell_of(p geometry) RETURNS text LANGUAGE sql AS $$
    SELECT feature_outbox._h3_cell(ST_X(p), ST_Y(p), current_setting('feature_outbox.h3_resolution')::integer)
$$;

-- As try(), with the error's DETAIL too, for refusals whose reason is in the detail (settings).
CREATE FUNCTION try_detail(sql text) RETURNS text LANGUAGE plpgsql AS $$
DECLARE
    state text; msg text; detail text; hint text;
BEGIN
    EXECUTE sql;
    RETURN 'ok';
EXCEPTION WHEN OTHERS THEN
    GET STACKED DIAGNOSTICS state = RETURNED_SQLSTATE, msg = MESSAGE_TEXT, detail = PG_EXCEPTION_DETAIL,
                            hint = PG_EXCEPTION_HINT;
    RETURN state || ': ' || msg || CASE WHEN detail <> '' THEN E'\n  DETAIL: ' || detail ELSE '' END
                 || CASE WHEN hint <> '' THEN E'\n  HINT: ' || hint ELSE '' END;
END
$$;

-- The SQLSTATE of a statement ('ok' when it ran), then each of `words` marked + when its message or
-- hint contains it and - when not: for messages that quote text PROJ or PostGIS own (CRS names,
-- areas of use), which differ between their versions.
CREATE FUNCTION try_says(sql text, VARIADIC words text[]) RETURNS text LANGUAGE sql AS $$
    SELECT split_part(r, ':', 1) || coalesce(' ' || (SELECT string_agg(CASE WHEN strpos(r, w) > 0 THEN '+' ELSE '-' END || w, ' ')
                                                      FROM unnest(words) w), '')
      FROM try(sql) r
$$;
