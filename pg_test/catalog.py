"""The SQL surface of feature_outbox in one database, as sorted lines of text that name objects by
identity, never by OID, so two databases can be compared line by line. pg_dump --schema-only leaves
extension members out, so it cannot serve.

Covered: every extension member; every relation of the schema with its columns (in order), types,
defaults, constraints, indexes, triggers, policies, options, owner, privileges and comments; views;
sequences; every function's full definition (signature, body, language, volatility, strictness,
parallel safety, SECURITY DEFINER, SET search_path), owner, privileges and comment; the schema's
owner and privileges; the initial privileges the extension recorded (what pg_dump restores); and the
extension's pg_extension_config_dump registrations."""

import psycopg

SCHEMA = "feature_outbox"

# Each query returns (kind, identity, detail) rows. %(s)s is the schema name.
QUERIES = {
    "member": """
        SELECT 'member', (pg_identify_object(d.classid, d.objid, d.objsubid)).type,
               (pg_identify_object(d.classid, d.objid, d.objsubid)).identity
          FROM pg_depend d JOIN pg_extension e ON d.refclassid = 'pg_extension'::regclass AND d.refobjid = e.oid
         WHERE e.extname = 'feature_outbox' AND d.deptype = 'e'""",
    "extension": """
        SELECT 'extension', e.extname,
               concat_ws(' ', 'version', e.extversion, 'schema', e.extnamespace::regnamespace,
                         'relocatable', e.extrelocatable, 'owner', e.extowner::regrole)
          FROM pg_extension e WHERE e.extname = 'feature_outbox'""",
    "config_dump": """
        SELECT 'config_dump', c.oid::regclass::text, coalesce(e.extcondition[i], '')
          FROM pg_extension e CROSS JOIN LATERAL generate_subscripts(e.extconfig, 1) i
          JOIN pg_class c ON c.oid = e.extconfig[i]
         WHERE e.extname = 'feature_outbox'""",
    "schema": """
        SELECT 'schema', n.nspname,
               concat_ws(' ', 'owner', n.nspowner::regrole, 'acl', n.nspacl::text, 'comment',
                         obj_description(n.oid, 'pg_namespace'))
          FROM pg_namespace n WHERE n.nspname = %(s)s""",
    "relation": """
        SELECT 'relation', c.oid::regclass::text,
               concat_ws(' ', 'kind', c.relkind, 'persistence', c.relpersistence, 'options', c.reloptions::text,
                         'owner', c.relowner::regrole, 'acl', c.relacl::text, 'rls', c.relrowsecurity,
                         c.relforcerowsecurity, 'replident', c.relreplident, 'comment', obj_description(c.oid, 'pg_class'))
          FROM pg_class c WHERE c.relnamespace = %(s)s::regnamespace""",
    "column": """
        SELECT 'column', c.oid::regclass::text || '.' || a.attname,
               concat_ws(' ', 'position', row_number() OVER (PARTITION BY c.oid ORDER BY a.attnum),
                         'type', format_type(a.atttypid, a.atttypmod), 'notnull', a.attnotnull,
                         'default', pg_get_expr(ad.adbin, ad.adrelid), 'identity', a.attidentity,
                         'generated', a.attgenerated, 'collation', a.attcollation::regcollation,
                         'acl', a.attacl::text, 'comment', col_description(c.oid, a.attnum))
          FROM pg_class c JOIN pg_attribute a ON a.attrelid = c.oid AND a.attnum > 0 AND NOT a.attisdropped
          LEFT JOIN pg_attrdef ad ON ad.adrelid = c.oid AND ad.adnum = a.attnum
         WHERE c.relnamespace = %(s)s::regnamespace AND c.relkind IN ('r', 'p', 'v', 'm', 'f', 'c')""",
    "constraint": """
        SELECT 'constraint', coalesce(co.conrelid::regclass::text, co.contypid::regtype::text) || '.' || co.conname,
               concat_ws(' ', pg_get_constraintdef(co.oid), 'deferrable', co.condeferrable, co.condeferred,
                         'comment', obj_description(co.oid, 'pg_constraint'))
          FROM pg_constraint co WHERE co.connamespace = %(s)s::regnamespace""",
    "index": """
        SELECT 'index', i.indexrelid::regclass::text, pg_get_indexdef(i.indexrelid)
          FROM pg_index i JOIN pg_class c ON c.oid = i.indrelid WHERE c.relnamespace = %(s)s::regnamespace""",
    "trigger": """
        SELECT 'trigger', t.tgrelid::regclass::text || '.' || t.tgname, pg_get_triggerdef(t.oid)
          FROM pg_trigger t JOIN pg_class c ON c.oid = t.tgrelid
         WHERE c.relnamespace = %(s)s::regnamespace AND NOT t.tgisinternal""",
    "policy": """
        SELECT 'policy', p.schemaname || '.' || p.tablename || '.' || p.policyname,
               concat_ws(' ', p.permissive, p.roles::text, p.cmd, p.qual, p.with_check)
          FROM pg_policies p WHERE p.schemaname = %(s)s""",
    "rule": """
        SELECT 'rule', r.schemaname || '.' || r.tablename || '.' || r.rulename, r.definition
          FROM pg_rules r WHERE r.schemaname = %(s)s""",
    "view": """
        SELECT 'view', c.oid::regclass::text, pg_get_viewdef(c.oid)
          FROM pg_class c WHERE c.relnamespace = %(s)s::regnamespace AND c.relkind IN ('v', 'm')""",
    "sequence": """
        SELECT 'sequence', s.seqrelid::regclass::text,
               concat_ws(' ', format_type(s.seqtypid, NULL), s.seqstart, s.seqincrement, s.seqmin, s.seqmax,
                         s.seqcache, s.seqcycle, 'owned by',
                         (SELECT d.refobjid::regclass::text || '.' || a.attname
                            FROM pg_depend d JOIN pg_attribute a ON a.attrelid = d.refobjid AND a.attnum = d.refobjsubid
                           WHERE d.classid = 'pg_class'::regclass AND d.objid = s.seqrelid AND d.deptype IN ('a', 'i')))
          FROM pg_sequence s JOIN pg_class c ON c.oid = s.seqrelid WHERE c.relnamespace = %(s)s::regnamespace""",
    "function": """
        SELECT 'function', p.oid::regprocedure::text,
               concat_ws(E'\\n', CASE WHEN p.prokind IN ('f', 'p', 'w') THEN pg_get_functiondef(p.oid) END,
                         'kind ' || p.prokind::text, 'cost ' || p.procost::text, 'rows ' || p.prorows::text,
                         'leakproof ' || p.proleakproof::text, 'owner ' || p.proowner::regrole::text,
                         'acl ' || coalesce(p.proacl::text, '(default)'),
                         'comment ' || obj_description(p.oid, 'pg_proc'))
          FROM pg_proc p WHERE p.pronamespace = %(s)s::regnamespace""",
    "type": """
        SELECT 'type', t.oid::regtype::text,
               concat_ws(' ', t.typtype, 'owner', t.typowner::regrole, 'acl', t.typacl::text,
                         'comment', obj_description(t.oid, 'pg_type'))
          FROM pg_type t
         WHERE t.typnamespace = %(s)s::regnamespace AND t.typelem = 0
           AND NOT EXISTS (SELECT 1 FROM pg_class c WHERE c.oid = t.typrelid AND c.relkind <> 'c')""",
    "init_privs": """
        SELECT 'init_privs', (pg_identify_object(ip.classoid, ip.objoid, ip.objsubid)).identity,
               ip.privtype::text || ' ' || ip.initprivs::text
          FROM pg_init_privs ip
         WHERE (pg_identify_object(ip.classoid, ip.objoid, ip.objsubid)).schema = %(s)s
            OR (ip.classoid = 'pg_namespace'::regclass AND ip.objoid = %(s)s::regnamespace)""",
}


def snapshot(conn: psycopg.Connection) -> list[str]:
    """The surface as sorted 'kind identity: detail' lines; multi-line details stay one entry."""
    lines = []
    for query in QUERIES.values():
        for kind, identity, detail in conn.execute(query, {"s": SCHEMA}).fetchall():
            lines.append(f"{kind} {identity}: {detail}")
    return sorted(lines)
