"""Which names hold credentials: config keys (`logger.wandb.api_key`, `+logger.gh_pat`), keys of a DeepSpeed JSON
(`comet.api_key`) and environment variables (`HF_TOKEN`, `SLACK_BOT_TOKEN`).

A name is cut into words (`_ - .`, camelCase and digits split it: `mlflowTrackingPassword` -> mlflow tracking
password) and judged by the well-known credential families, word by word, never by substring, so `patience`,
`path`, `pattern`, `author`, `tokenizer`, `max_new_tokens` are not secrets:

* words that name a credential wherever they stand: secret, password, passwd, passphrase, credential(s), auth,
  oauth, bearer, cookie, pat, private, signature, dsn, jwt, ... (and words ending in one: `dbpassword`,
  `clientsecret`, `openaiapikey`);
* nouns that are credentials only at the end of a name: `key` (`api_key`, `wandb_key`, not `sort_key`,
  `num_key_value_heads`), `token` (`hf_token`, `slack_bot_token`, not `pad_token`, `end_of_conversation_token`,
  `token_count`), `session` (`session`, `session_id`, not `DESKTOP_SESSION`), `sig`, `pass`, `pwd` (not `PWD`,
  the working directory);
* a descriptor after the credential word says the value is about it, not it: `password_file`, `token_path`,
  `auth_type`, `secret_name`, `api_key_env`, `SSH_AUTH_SOCK` are not secrets.

Wrongly calling a name secret costs little (its value is hidden, the run still sees it); missing one leaks it,
so an unknown qualifier (`openai_key`, `acme_token`) counts as a credential.

Import-light: no third-party imports.
"""

from __future__ import annotations

import re


def _set(words: str) -> frozenset[str]:
    return frozenset(words.split())


# a credential wherever the word stands (unless a descriptor follows it)
CREDENTIAL_WORDS = _set(
    """secret secrets password passwords passwd passphrase passcode passkey credential credentials creds cred auth
    oauth authorization bearer cookie cookies pat private privkey apikey signature dsn jwt otp totp"""
)
# one word ending in a credential: `dbpassword`, `clientsecret`, `openaiapikey`, `authtoken`
_COMPOUND = re.compile(r"(password|passwd|secret|apikey|accesskey|secretkey|privatekey|authtoken|accesstoken)$")
# credential nouns at the end of a name, with the words before them that make them something else
NOUN_QUALIFIERS: dict[str, frozenset[str]] = {
    "key": _set(
        """sort text prompt chosen rejected response completion message messages conversation column field data
        dataset cache hash dict map group label input output name metric role content image primary foreign
        partition lookup index join sample split feature sequence state config checkpoint trajectory module param
        parameter layer model result sweep choice override lock row record item entry unique shard job run task
        query attention kv instruction question answer context history chat template source target monitor dedup
        order resume study trial objective experiment"""
    ),
    "token": _set(
        """pad eos bos unk sep cls mask end start begin stop special conversation eot eom image audio video tool
        think chat system user assistant default added extra placeholder first last next prefix suffix turn
        separator vocab decoder generation response prompt fill middle fim boundary control reserved role
        instruction answer question new output"""
    ),
    "session": _set("desktop xdg term terminal tmux screen login shell training"),
    "sig": frozenset(),
    "pass": _set("first second third forward backward multi single one two"),
    "pwd": frozenset(),
}
# what may follow a credential noun and keep it the credential: `api_key_value`, `session_id`
VALUE_WORDS = _set("value string str b64 base64 hex bytes raw id")
# what makes the name about a credential rather than the credential itself
DESCRIPTORS = _set(
    """name names path paths file files filename dir directory folder type types mode method kind env var variable
    enabled enable disabled required source count num len length size url uri host port endpoint server sock socket
    timeout ttl expiry expires format field column prefix provider scope scopes location manager helper command
    cmd"""
)

_CAMEL = re.compile(r"(?<=[a-z0-9])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])")


def words_of(name: str) -> list[str]:
    """`mlflowTrackingPassword` -> [mlflow, tracking, password]; `HF_TOKEN2` -> [hf, token, 2]."""
    return re.findall(r"[a-z]+|[0-9]+", _CAMEL.sub("_", name).lower())


def is_secret_name(name: object) -> bool:
    """Whether a key or environment variable named `name` holds a credential (see the module docstring)."""
    words = [w for w in words_of(str(name)) if not w.isdigit()]
    for i, word in enumerate(words):
        rest = words[i + 1 :]
        if any(r in DESCRIPTORS for r in rest):
            continue
        if word in CREDENTIAL_WORDS or _COMPOUND.search(word):
            return True
        qualifiers = NOUN_QUALIFIERS.get(word)
        if qualifiers is None or not all(r in VALUE_WORDS for r in rest):
            continue
        if word == "pwd" and len(words) == 1:  # $PWD, the working directory
            continue
        if i == 0 or words[i - 1] not in qualifiers:
            return True
    return False
