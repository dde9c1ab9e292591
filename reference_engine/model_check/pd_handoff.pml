/* The reference engine's prefill/decode (PD) handoff, in Promela (reference_engine/model_check).

   What it models, per request r (N requests, each a Client, a Prefill and a Decode process):
     client     sends the request; may drop it at any point before it ends (client abort)
     decode     intake with its own, larger pool; preallocates pages for the full prompt;
                publishes the reservation (bootstrap room r, TransferMetadata); awaits the
                room's status; commits after its checks; decodes NUM_STEPS steps, each reading
                every page of its block table; on abort frees its pages (or, deferred_release,
                holds them until prefill's drain ack)
     prefill    intake: a prompt over its own input limit gets the one-token placeholder and a
                deferred 400 (admission_retire: retired at once, FAILED rejected); bootstrap
                (waits for decode's metadata or a cancel); the capacity check on what the
                prompt now is; allocates its pages; sends min(src, dst) pages, one write per
                page, each in flight between its post and its landing (decode may cancel, free
                and reuse the pages meanwhile: the in-flight write); concludes Success or Failed
                once its writes drained; frees its pages
     pool       decode's NUM_PAGES pages: owner, whose KV is in each (kv), the allocation
                generation and the owner tag stamped by the writer. Allocation picks ANY free
                page, so both free orders of the engine (lifo, sorted) are covered.

   Sizes, in pages: a request's prompt is 1 page (fits prefill's input limit) or, with
   ALLOW_OVERPOOL, 2 pages (over prefill's input limit, which a 2-page prefill pool lowers
   below two full pages, as max_req_input_len = pool - 1 - 5 does; decode's pool takes it).

   Fix switches (0/1 #defines, set by the runner): ADMISSION_RETIRE, COVERAGE_CHECK,
   KV_CHECKSUM, PAGE_TAGS, ZERO_ON_FREE, DEFERRED_RELEASE, POOL_COVERS_CONTEXT. Environment:
   ALLOW_OVERPOOL, ALLOW_ABORT (which requests may be dropped: a bit mask), RELEASE_TIMEOUT
   (deferred_release may give up waiting for the drain ack). PROPERTY: 1 decode never reads
   another request's KV (the leak), 2 decode never reads a page not written for the request it
   serves (the leak, or zeros / a never-written page).

   Properties checked: the read property above (assert at every read); a page is never owned
   by two requests (assert at allocation and free); no page is lost and every request ended
   (asserts once every process is done); every request ends (an invalid end state otherwise).
   Lines starting with "@" are the steps a counterexample is rendered from (model_check.trail).
   Decode writes its generated tokens into the prompt's last page (checking every tag, then
   restamping that page's, each step, as decode_scheduler does); pages for more tokens, the prefix cache and
   timing are deliberately not modelled.
*/

#ifndef N
#define N 2
#endif
#define NUM_PAGES 3
#define PREFILL_PAGES 2
#define MAX_PAGES 2
#define NUM_STEPS 2
#define NOBODY 0
/* transfer status of a room */
#define PENDING 0
#define SUCCESS 4
#define FAILED 1

#define OWNER(r) (r + 1)
#define DP(r, i) dp[(r) * MAX_PAGES + (i)]
#define DG(r, i) dg[(r) * MAX_PAGES + (i)]

byte owner[NUM_PAGES];   /* decode pool: OWNER(r) or NOBODY */
byte kv[NUM_PAGES];      /* whose KV the page holds: OWNER(r), or NOBODY (never written / zeroed) */
byte gen[NUM_PAGES];     /* bumped on every allocation */
byte tag[NUM_PAGES];     /* the generation stamped by the last write (page_tags) */
byte decode_free = NUM_PAGES;
byte prefill_free = PREFILL_PAGES;

byte num_pages[N];       /* the prompt in pages, as decode sees it */
byte dp[N * MAX_PAGES];  /* decode's block table */
byte dg[N * MAX_PAGES];  /* the generations decode allocated */
bool meta[N];            /* decode registered its reservation for room r */
bool cancelled[N];       /* decode cancelled room r */
byte status[N];          /* prefill concluded room r: PENDING, SUCCESS, FAILED */
bool rejected[N];        /* FAILED because prefill's intake rejected it */
byte num_written[N];     /* pages prefill sent (coverage_check) */
bool dropped[N];         /* the client dropped the request */
bool ended[N];           /* the client has its answer (or gave up) */
bool decode_done[N];
bool prefill_done[N];

inline free_pages(r) {
  i = 0;
  do
  :: i < num_alloc ->
     assert(owner[DP(r, i)] == OWNER(r));  /* a page is never owned by two requests */
     owner[DP(r, i)] = NOBODY;
     if
     :: ZERO_ON_FREE -> kv[DP(r, i)] = NOBODY
     :: else -> skip
     fi;
     i++
  :: else -> break
  od;
  decode_free = decode_free + num_alloc;
  num_alloc = 0
}

inline check_read(r, p) {
  printf("@%d decode reads page %d (holds KV of %d)\n", r, p, kv[p]);
#if PROPERTY == 1
  assert(kv[p] == OWNER(r) || kv[p] == NOBODY);  /* decode reads another request's KV */
#else
  assert(kv[p] == OWNER(r));  /* decode reads a page not written for its request */
#endif
}

proctype Client(byte r) {
  do
  :: ended[r] -> break
  :: ((ALLOW_ABORT >> r) & 1) && !ended[r] ->
     atomic { dropped[r] = true; ended[r] = true; printf("@%d client drops the request\n", r) }
     break
  od
}

proctype Decode(byte r) {
  byte i, p, q, k, step;
  byte num_alloc = 0;
  bool registered = false;
  if
  :: num_pages[r] > 1 && POOL_COVERS_CONTEXT ->  /* the pools cover the context: it is over it */
     printf("@%d decode rejects the prompt at intake: over the context (400)\n", r);
     cancelled[r] = true; goto done
  :: else -> skip
  fi;
  /* preallocation: the full prompt, in decode's own (larger) pool */
  do
  :: dropped[r] -> goto abort
  :: atomic {
       decode_free >= num_pages[r] ->
       decode_free = decode_free - num_pages[r];
       i = 0;
       do
       :: i < num_pages[r] ->
          p = 0;
          do  /* any free page: take this one or, if one is free above it, look further */
          :: true ->
             k = 0; q = p + 1;
             do
             :: q < NUM_PAGES -> k = k + (owner[q] == NOBODY); q++
             :: else -> break
             od;
             if
             :: owner[p] == NOBODY -> break
             :: k > 0 -> p++
             fi
          od;
          assert(owner[p] == NOBODY);
          owner[p] = OWNER(r); gen[p]++; DP(r, i) = p; DG(r, i) = gen[p];
          printf("@%d decode allocates page %d\n", r, p);
          i++; num_alloc++
       :: else -> break
       od;
       i = 0; p = 0; q = 0; k = 0  /* scratch: keep the state vector small */
     };
     break
  od;
  atomic { registered = true; meta[r] = true; printf("@%d decode publishes its reservation\n", r) }
  /* await the room's status */
  if
  :: status[r] != PENDING -> skip
  :: dropped[r] -> goto abort
  fi;
  /* commit */
  atomic {
    if
    :: status[r] == FAILED ->
       if
       :: rejected[r] -> printf("@%d decode ends: prefill rejected the prompt (400)\n", r)
       :: else -> printf("@%d decode ends: transfer failed\n", r)
       fi;
       goto release
    :: else -> skip
    fi;
    if
    :: COVERAGE_CHECK && num_written[r] != num_pages[r] ->
       printf("@%d decode ends: coverage mismatch (400)\n", r); goto release
    :: else -> skip
    fi;
    if
    :: KV_CHECKSUM ->
       i = 0;
       do
       :: i < num_pages[r] ->
          if
          :: num_written[r] != num_pages[r] || kv[DP(r, i)] != OWNER(r) ->
             printf("@%d decode ends: checksum mismatch (400)\n", r); goto release
          :: else -> i++
          fi
       :: else -> break
       od
    :: else -> skip
    fi;
    i = 0;
    do
    :: PAGE_TAGS && i < num_pages[r] ->
       if
       :: tag[DP(r, i)] != DG(r, i) ->
          printf("@%d decode ends: page tag mismatch on page %d\n", r, DP(r, i)); goto release
       :: else -> i++
       fi
    :: else -> break
    od;
    i = 0;
    printf("@%d decode commits (room %d checked)\n", r, r)
  };
  /* decode steps: every step reads every page of the block table */
  step = 0;
  do
  :: step == NUM_STEPS -> printf("@%d decode finishes (200)\n", r); goto release
  :: step < NUM_STEPS && dropped[r] -> goto abort
  :: step < NUM_STEPS ->
     atomic {
       /* decode checks every page's tag before it stamps the page the step's token goes
          into (the prompt's last page: prompts end mid-page) with its own generation, so a
          late write there is caught rather than re-stamped (decode_scheduler) */
       i = 0;
       do
       :: i < num_pages[r] ->
          if
          :: PAGE_TAGS && tag[DP(r, i)] != DG(r, i) ->
             printf("@%d decode ends: page tag mismatch on page %d\n", r, DP(r, i));
             goto release
          :: else -> check_read(r, DP(r, i)); i++
          fi
       :: else -> break
       od;
       tag[DP(r, num_pages[r] - 1)] = DG(r, num_pages[r] - 1);
       printf("@%d decode stamps page %d for its next token\n", r, DP(r, num_pages[r] - 1));
       i = 0; step++
     }
  od;
abort:
  /* the client is gone: an in-flight write may still land in these pages */
  if
  :: registered && status[r] == PENDING && DEFERRED_RELEASE ->
     cancelled[r] = true;
     printf("@%d decode aborts: holds its pages until prefill's drain ack\n", r);
     if
     :: status[r] != PENDING -> skip
     :: RELEASE_TIMEOUT -> printf("@%d decode: no drain ack before the timeout\n", r)
     fi;
     atomic { free_pages(r); printf("@%d decode frees its pages\n", r) }
  :: else ->
     atomic { free_pages(r); printf("@%d decode aborts and frees its pages\n", r) }
     cancelled[r] = true
  fi;
  goto done;
release:
  atomic { free_pages(r); printf("@%d decode frees its pages\n", r) }
done:
  atomic { ended[r] = true; decode_done[r] = true }
}

proctype Prefill(byte r) {
  byte num_src, num_send, i;
  byte allocated = 0;
  /* intake */
  if
  :: num_pages[r] > 1 && POOL_COVERS_CONTEXT ->
     printf("@%d prefill rejects the prompt at intake: over the context (400)\n", r);
     atomic { rejected[r] = true; status[r] = FAILED }; goto done
  :: num_pages[r] > 1 && !POOL_COVERS_CONTEXT && ADMISSION_RETIRE ->
     printf("@%d prefill rejects the prompt at admission (400)\n", r);
     atomic { rejected[r] = true; status[r] = FAILED }; goto done
  :: num_pages[r] > 1 && !POOL_COVERS_CONTEXT && !ADMISSION_RETIRE ->
     printf("@%d prefill swaps the prompt for the one-token placeholder, defers the 400\n", r);
     num_src = 1
  :: else -> num_src = num_pages[r]
  fi;
  /* bootstrap: wait for decode's metadata */
  if
  :: meta[r] -> printf("@%d prefill bootstrapped (room %d)\n", r, r)
  :: cancelled[r] || dropped[r] -> goto fail
  fi;
  /* the capacity check sees what the prompt now is; pages at the first chunk */
  assert(num_src <= PREFILL_PAGES);
  do
  :: atomic { prefill_free >= num_src -> prefill_free = prefill_free - num_src };
     allocated = num_src; break
  :: cancelled[r] || dropped[r] -> goto fail
  od;
  /* SGLang's sender: min(len(src), len(dst)) pages */
  num_send = (num_src < num_pages[r] -> num_src : num_pages[r]);
  i = 0;
  do
  :: i == num_send -> break
  :: i < num_send && (cancelled[r] || dropped[r]) -> goto fail
  :: i < num_send ->
     printf("@%d prefill posts its write to decode page %d\n", r, DP(r, i));
     /* in flight: decode may cancel, free and reuse the page before it lands */
     atomic {
       kv[DP(r, i)] = OWNER(r); tag[DP(r, i)] = DG(r, i);
       printf("@%d prefill's write lands in page %d\n", r, DP(r, i))
     };
     i++
  od;
  atomic {
    num_written[r] = num_send; status[r] = SUCCESS;
    printf("@%d prefill concludes Success (%d pages sent)\n", r, num_send)
  };
  goto release;
fail:
  atomic { status[r] = FAILED; printf("@%d prefill concludes Failed\n", r) };
release:
  prefill_free = prefill_free + allocated;
done:
  prefill_done[r] = true
}

init {
  byte r, pg;
  atomic {
    r = 0;
    do
    :: r < N ->
       if
       :: num_pages[r] = 1
       :: ALLOW_OVERPOOL -> num_pages[r] = 2
       fi;
       printf("@%d client sends the request: %d page(s)\n", r, num_pages[r]);
       run Client(r); run Decode(r); run Prefill(r);
       r++
    :: else -> break
    od
  };
  (_nr_pr == 1);  /* every request ends: otherwise an invalid end state */
  r = 0;
  do
  :: r < N -> assert(ended[r] && decode_done[r] && prefill_done[r]); r++
  :: else -> break
  od;
  pg = 0;
  do
  :: pg < NUM_PAGES -> assert(owner[pg] == NOBODY); pg++  /* no page is lost */
  :: else -> break
  od;
  assert(prefill_free == PREFILL_PAGES)
}
